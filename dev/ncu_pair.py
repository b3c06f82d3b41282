"""One forward (or backward) call of fastsoftmax auto or QuACK between cudaProfilerStart/Stop, after three
warm-up calls, for Nsight Compute with --profile-from-start off: the two kernels' memory traffic side by side.
Usage: ncu --profile-from-start off --metrics ... python dev/ncu_pair.py fastsoftmax|quack DTYPE M N [fwd|bwd]"""

import sys

import torch

impl, dt, m, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pass_ = sys.argv[5] if len(sys.argv) > 5 else "fwd"
x = torch.randn(m, n, device="cuda", dtype=getattr(torch, dt))
y, dy = torch.softmax(x, -1), torch.randn_like(x)
if impl == "quack":
    from quack.softmax import softmax_bwd, softmax_fwd

    call = (lambda: softmax_fwd(x)) if pass_ == "fwd" else (lambda: softmax_bwd(dy, y))
else:
    import fastsoftmax as fs

    call = (lambda: fs.softmax(x)) if pass_ == "fwd" else (lambda: fs.softmax_backward(dy, y))
for _ in range(3):
    call()
torch.cuda.synchronize()
torch.cuda.profiler.start()
call()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
