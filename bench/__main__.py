"""`python -m bench`: the README's main job. Until the encoder-layer benchmark lands it runs
the fused-op benchmark (jaxsub vs plain XLA vs the memory floor); on a machine without a
GPU it runs the small CPU configuration."""

import sys

import jax

from bench import ops

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(d.platform == "gpu" for d in jax.devices()) and "--small" not in argv:
        argv = ["--small", *argv]
    sys.exit(ops.main(argv))
