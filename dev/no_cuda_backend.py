"""The `fastsoftmax` command as a machine without the CUDA backend's extra runs it (neither `[cu13]` nor
`[cu12]` installed: cuda-python's bindings cannot be imported), for the portability measurement:

    python dev/no_cuda_backend.py bench --impls fastsoftmax,copy --jobs 0 --json OUT.json

(--jobs 0: the warm-up workers are separate processes, which would import the bindings.)
"""

import sys

sys.modules["cuda.bindings"] = None  # an import of it now raises ImportError, as where it is not installed

from fastsoftmax.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
