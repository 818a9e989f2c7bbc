"""A small BERT on jaxsub.flax.Encoder, trained with optax on a synthetic masked-LM task.

Model: token + position embeddings, layer norm, dropout, `jaxsub.flax.Encoder` (post-LN
BERT layers on jaxsub's fused kernels, scanned over layers), and BERT's MLM head (dense,
GELU, layer norm, output projection tied to the token embedding).

Task (learnable, so the loss has somewhere to go): each sequence is random tokens sorted
ascending. 15% of the positions are replaced by [MASK] (BERT's 80/10/10 rule left out for
brevity) and the model predicts them. A masked token lies between its visible neighbours
and near the value its position suggests, so a model that learns to use position and its
neighbours drives the loss far below the chance level log(vocab).

    python examples/flax_bert.py                 # --size tiny on CPU, large on a GPU
    python examples/flax_bert.py --size large    # BERT-large (24 x 1024, 16 heads), bf16
    python examples/flax_bert.py --steps 100 --log-every 10
    python examples/flax_bert.py --data-parallel # the batch sharded over every device

With --data-parallel the batch (the size's batch per device) is sharded over all devices
and the parameters and optimizer state are replicated; `jit` then partitions the step as
usual, and jaxsub's kernels run on each device's examples (README, "Several devices").

Prints the training loss and masked-token accuracy as it goes, steps/s, and a final
evaluation without dropout. Needs optax (`pip install optax`, or jaxsub's `examples` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsub

PAD, MASK, FIRST_TOKEN = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Size:
    vocab: int
    seq: int
    hidden: int
    heads: int
    mlp: int
    layers: int
    batch: int
    lr: float
    dtype: Any


SIZES = {
    "tiny": Size(vocab=64, seq=32, hidden=64, heads=4, mlp=256, layers=2, batch=32, lr=2e-3,
                 dtype=jnp.float32),
    # BERT-large's encoder, vocabulary and sequence length.
    "large": Size(vocab=30522, seq=512, hidden=1024, heads=16, mlp=4096, layers=24, batch=8, lr=1e-4,
                  dtype=jnp.bfloat16),
}


class BertMLM(nn.Module):
    size: Size
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        s = self.size
        embed = nn.Embed(s.vocab, s.hidden, embedding_init=nn.initializers.normal(0.02), name="token_embed")
        positions = self.param("position_embed", nn.initializers.normal(0.02), (tokens.shape[1], s.hidden))
        x = embed(tokens) + positions
        x = nn.LayerNorm(name="embed_norm")(x)
        x = nn.Dropout(self.dropout_rate, deterministic=deterministic)(x)
        x = jaxsub.flax.Encoder(num_layers=s.layers, num_heads=s.heads, mlp_dim=s.mlp,
                                dropout_rate=self.dropout_rate, attention_dropout_rate=self.dropout_rate,
                                dtype=s.dtype, scan_layers=True, name="encoder")(
            x, mask=tokens != PAD, deterministic=deterministic)
        x = nn.gelu(nn.Dense(s.hidden, dtype=s.dtype, name="mlm_dense")(x), approximate=False)
        x = nn.LayerNorm(dtype=s.dtype, name="mlm_norm")(x)
        bias = self.param("mlm_bias", nn.initializers.zeros, (s.vocab,))
        return embed.attend(x.astype(jnp.float32)) + bias


def make_batch(rng: np.random.Generator, size: Size, mask_rate: float = 0.15):
    """(inputs, labels, weights): labels are the original tokens, weights 1 where the
    input was masked."""
    labels = np.sort(rng.integers(FIRST_TOKEN, size.vocab, (size.batch, size.seq)), axis=1)
    masked = rng.random(labels.shape) < mask_rate
    masked[:, 0] |= ~masked.any(axis=1)             # at least one prediction per sequence
    inputs = np.where(masked, MASK, labels)
    return jnp.asarray(inputs, jnp.int32), jnp.asarray(labels, jnp.int32), jnp.asarray(masked, jnp.float32)


def masked_loss(logits, labels, weights):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    total = jnp.maximum(weights.sum(), 1.0)
    return jnp.sum(losses * weights) / total, jnp.sum(correct * weights) / total


def train(size_name: str, steps: int, seed: int = 0, log_every: int = 25, log=print, devices=None) -> dict:
    """Trains for `steps` steps; returns the per-step losses and accuracies, steps/s
    (after the first, compiling, step) and a final evaluation without dropout. `devices`:
    a list of devices to shard the batch over (data parallelism, the size's batch on each),
    or None (one device)."""
    size = SIZES[size_name]
    model = BertMLM(size)
    if devices is not None:
        size = dataclasses.replace(size, batch=size.batch * len(devices))
        mesh = jax.sharding.Mesh(np.array(devices), ("data",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        batch_sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    rng = np.random.default_rng(seed)
    tokens, labels, weights = make_batch(rng, size)
    params = jax.jit(model.init)(jax.random.key(seed), tokens)["params"]
    n_params = sum(p.size for p in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, size.lr, max(1, steps // 10), max(steps, 2))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = tx.init(params)
    if devices is not None:
        params, opt_state = jax.device_put((params, opt_state), replicated)

    def batch(rng):
        b = make_batch(rng, size)
        return b if devices is None else jax.device_put(b, batch_sharded)

    @jax.jit
    def step(params, opt_state, tokens, labels, weights, key):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens, deterministic=False, rngs={"dropout": key})
            return masked_loss(logits, labels, weights)

        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    @jax.jit
    def evaluate(params, tokens, labels, weights):
        return masked_loss(model.apply({"params": params}, tokens), labels, weights)

    where = f"{len(devices)} devices, batch sharded" if devices is not None else "device"
    log(f"BERT-{size_name}: {size.layers} layers x {size.hidden}, {size.heads} heads, vocab {size.vocab}, "
        f"sequence {size.seq}, batch {size.batch}, {jnp.dtype(size.dtype).name}, "
        f"{n_params / 1e6:.2f}M parameters; {where} {jax.devices()[0].device_kind}; "
        f"chance loss log(vocab) = {np.log(size.vocab - FIRST_TOKEN):.2f}")
    losses, accs = [], []
    key = jax.random.key(seed + 1)
    start = None
    for i in range(steps):
        if i == 1:
            jax.block_until_ready(params)
            start = time.perf_counter()     # step 0 compiles
        tokens, labels, weights = batch(rng)
        params, opt_state, loss, acc = step(params, opt_state, tokens, labels, weights, jax.random.fold_in(key, i))
        if (i + 1) % log_every == 0 or i == 0 or i == steps - 1:
            loss_now, acc_now = float(loss), float(acc)  # waits for step i, so the rate counts it
            rate = "" if start is None or i == 0 else f"  {i / (time.perf_counter() - start):.1f} steps/s"
            log(f"step {i + 1:5d}  loss {loss_now:.3f}  masked accuracy {acc_now:.3f}{rate}")
        losses.append(loss)
        accs.append(acc)
    jax.block_until_ready(params)
    steps_per_s = (steps - 1) / (time.perf_counter() - start) if start is not None and steps > 1 else None
    eval_loss, eval_acc = evaluate(params, *batch(np.random.default_rng(seed + 99)))
    result = {"losses": [float(x) for x in losses], "accuracies": [float(x) for x in accs],
              "steps_per_s": steps_per_s, "eval_loss": float(eval_loss), "eval_accuracy": float(eval_acc)}
    log(f"done: {steps} steps, {steps_per_s or float('nan'):.2f} steps/s; eval without dropout: "
        f"loss {result['eval_loss']:.3f}, masked accuracy {result['eval_accuracy']:.3f}")
    return result


def main(argv=None) -> int:
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="large" if has_gpu else "tiny",
                   help="default: large on a GPU, tiny otherwise")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-parallel", action="store_true",
                   help="shard the batch over every device (the size's batch on each)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first and the last losses are compared)")
    if args.log_every < 1:
        p.error("--log-every must be >= 1")
    result = train(args.size, args.steps, args.seed, args.log_every,
                   devices=jax.devices() if args.data_parallel else None)
    n = min(5, len(result["losses"]) // 2)  # the first and last n steps, apart
    first, last = np.mean(result["losses"][:n]), np.mean(result["losses"][-n:])
    print(f"loss: first steps {first:.3f} -> last steps {last:.3f}")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
