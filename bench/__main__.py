"""`python -m bench`: the README's main job, the encoder-layer benchmark (bench/encoder.py):
the BERT-large layer and 24-layer stack, forward + backward with dropout, jaxsub against
plain XLA, Flax and cuDNN attention. On a machine without a GPU it runs the small CPU
configuration (`--small`). The fused-op benchmark is `python -m bench.ops`."""

import sys

import jax

from bench import encoder

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(d.platform == "gpu" for d in jax.devices()) and "--small" not in argv:
        print("no GPU found: running the small CPU configuration (--small)", flush=True)
        argv = ["--small", *argv]
    sys.exit(encoder.main(argv))
