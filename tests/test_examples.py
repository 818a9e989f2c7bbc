"""The examples run on CPU: decorate.py's optimized layer matches the undecorated one, and
flax_bert.py's loss goes down in a short tiny run, and its data-parallel training on four
CPU devices follows the one-device training."""

from __future__ import annotations

import textwrap

import numpy as np

# `examples` is not part of the installed package: tests/conftest.py puts the repository
# root on sys.path.
from examples import decorate, flax_bert


def test_decorate_fuses_the_layer_and_matches_the_undecorated_function(capsys):
    assert decorate.main([]) == 0
    printed = capsys.readouterr().out
    assert "Totals: attention x1, bias_dropout_residual_layer_norm x2, bias_gelu_dropout x1" in printed
    assert "numbers match" in printed and "MISMATCH" not in printed
    assert "jaxsub_bdrln_fwd" in printed and "jaxsub_bias_gelu_dropout_fwd" in printed


def test_decorate_compare_reports_a_real_mismatch():
    """The check can fail: an undecorated layer whose output is off by 1% is caught."""
    plain = decorate.encoder_layer.__wrapped__
    result = decorate.compare(plain=lambda *a, **k: plain(*a, **k) * 1.01)
    assert not result["ok"] and any(f.startswith("y") for f in result["failures"])


def test_flax_bert_tiny_loss_decreases():
    result = flax_bert.train("tiny", steps=40, log_every=1000, log=lambda *_: None)
    losses = np.asarray(result["losses"])
    assert losses.shape == (40,) and np.isfinite(losses).all()
    assert losses[-5:].mean() < losses[:5].mean() - 0.2, losses
    assert result["steps_per_s"] > 0 and np.isfinite(result["eval_loss"])


_DATA_PARALLEL = textwrap.dedent("""
    import dataclasses
    import jax, numpy as np
    from examples import flax_bert

    assert len(jax.devices()) == 4
    # The same global batch (4 x 32) on one device and sharded over four.
    flax_bert.SIZES["tiny128"] = dataclasses.replace(flax_bert.SIZES["tiny"], batch=128)
    quiet = lambda *_: None
    one = flax_bert.train("tiny128", steps=4, log=quiet)
    four = flax_bert.train("tiny", steps=4, log=quiet, devices=jax.devices())
    for key in ("losses", "accuracies"):
        np.testing.assert_allclose(four[key], one[key], rtol=2e-5, atol=2e-5, err_msg=key)
    np.testing.assert_allclose(four["eval_loss"], one["eval_loss"], rtol=2e-5)
    print("ok", one["losses"], four["losses"])
""")


def test_flax_bert_data_parallel_follows_one_device(four_cpu_devices):
    four_cpu_devices(_DATA_PARALLEL)
