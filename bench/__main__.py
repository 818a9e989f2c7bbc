"""`python -m bench`: the README's main job, the encoder-layer benchmark (bench/encoder.py):
the BERT-large layer and 24-layer stack, forward + backward with dropout, jaxsub against
plain XLA, Flax and cuDNN attention. On a machine without a GPU it (as every benchmark) runs
the small CPU configuration (`--small`). The fused-op benchmark is `python -m bench.ops`."""

import sys

from bench import encoder

if __name__ == "__main__":
    sys.exit(encoder.main(sys.argv[1:]))
