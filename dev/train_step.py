"""One training step (forward, backward, AdamW) of a randomly initialised Llama-3-style model, bf16, for the
unpatched model, fastsoftmax.integrations.transformers.apply(), Liger-Kernel's patch and CCE's patch: peak
memory (torch.cuda.max_memory_allocated over the timed steps, optimizer states included) and tokens/s (the
median of the timed steps after warm-up). Each variant and batch shape runs in a fresh subprocess, so a
class-level patch (Liger's, CCE's) never leaks into another run. The issue's target, per batch shape:
fastsoftmax the fastest of the four, its peak at most 1% above the lowest.

The model is Llama 3.2 1B's shape (vocabulary 128256, hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, tied embeddings: 1.24e9 parameters), sdpa attention, AdamW (fused) on bf16 weights. Liger
runs its fused linear cross-entropy alone (``liger``: rope, RMSNorm and SwiGLU stay torch's, as in the other
three) and with its defaults (``liger_all``: its RMSNorm, SwiGLU and RoPE kernels too, recorded beside, not
one of the four). CCE's PyPI wheels have no transformers patch (``cut_cross_entropy.transformers`` is in its
git tree only): without it, CCE's linear_cross_entropy replaces fs.linear_cross_entropy inside fastsoftmax's
patched forward, so only the loss differs. A peer that does not import is recorded with the reason, not run.
Recorded beside the four too: ``fastsoftmax_chunks`` (apply(memory=) of the loss's own default
chunk, at least 2048 rows, 525 MB of logits at this vocabulary: apply()'s default before STEP_SHARE),
``fastsoftmax_dw8`` (apply(memory=) of dW's bytes / 8; apply()'s default is / heuristics.lm_head.STEP_SHARE)
and ``fastsoftmax_eager`` (eager attention with fs.softmax, attention_softmax=True, in place of sdpa).
The variants through fastsoftmax's forward record their peak split around the loss (_peak_split): how
much of the step's peak is the loss's.

    python dev/train_step.py OUT.json                 # on the GPU: 1x4096, 1x8192 and 8x1024 tokens
    python dev/train_step.py OUT.json --tiny          # on the CPU: a 2-layer model, the code paths only
    python dev/train_step.py OUT.json --merge A.json B.json   # runs of one shape each, joined
    PYTHONPATH=/tmp/site:$PWD/src python dev/train_step.py bench/results/h200_train_step.json   (dev/peers.sh)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time

VARIANTS = ("unpatched", "fastsoftmax", "liger", "cce", "liger_all", "fastsoftmax_chunks", "fastsoftmax_dw8",
            "fastsoftmax_eager")  # fmt: skip
FOUR = VARIANTS[:4]  # (the comparison; the others are recorded beside)
SHARES = {"fastsoftmax_dw8": 8}  # apply(memory=) of dW's bytes / this
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(LLAMA_1B, vocab_size=1031, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
TINY.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="JSON file the results are written to")
    p.add_argument(
        "--shapes", nargs="+", default=["1x4096", "1x8192", "8x1024"], help="batches as ROWSxTOKENS (rows of tokens)"
    )
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (kernel compiles, allocator)")
    p.add_argument("--steps", type=int, default=5, help="timed steps; tokens/s from their median")
    p.add_argument("--timeout", type=int, default=240, help="seconds one variant may take")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks the code paths")
    p.add_argument("--merge", nargs="+", metavar="PART", help="join earlier runs' files (one per shape, say) into OUT")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # VARIANT:SEQ, in the subprocess
    return p


# ---- one variant, in its own process --------------------------------------------------------------------


def _patch(variant: str, model, tokens: int):
    """Applies variant's patch to model (in this process); returns the model to train."""
    if variant.startswith("fastsoftmax"):
        from fastsoftmax.integrations import transformers as fst

        if variant == "fastsoftmax_eager":  # fs.softmax in eager attention (from sdpa) as well as the loss
            model.set_attn_implementation("eager")
            return fst.apply(model, attention_softmax=True)
        from fastsoftmax.heuristics import lm_head as rules

        head = model.get_output_embeddings().weight
        (v, d), size = head.shape, head.element_size()
        memory = v * d * size // SHARES[variant] if variant in SHARES else None
        if variant == "fastsoftmax_chunks":  # (the loss's default chunk at this many tokens, as a budget)
            memory = rules.chunk_rows(tokens, d, v, size, None, None) * v * size
        return fst.apply(model, memory=memory)
    if variant in ("liger", "liger_all"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        opts = dict(fused_linear_cross_entropy=True, cross_entropy=False, model=model)
        if variant == "liger":
            opts.update(rope=False, rms_norm=False, swiglu=False)
        known = inspect.signature(apply_liger_kernel_to_llama).parameters
        apply_liger_kernel_to_llama(**{k: v for k, v in opts.items() if k in known})
        return model
    if variant == "cce":
        import cut_cross_entropy

        try:
            from cut_cross_entropy.transformers import cce_patch
        except ModuleNotFoundError:  # (the PyPI wheels have no transformers patch: it is in CCE's git tree only)
            model = _cce_through_our_forward(model, cut_cross_entropy.linear_cross_entropy)
            model.train_step_note = "CCE's linear_cross_entropy in fastsoftmax's patched forward (no cce_patch)"
            return model
        return cce_patch(model)
    return model


def _cce_through_our_forward(model, cce_loss):
    """CCE's linear_cross_entropy (shift=True: hidden[:, :-1] against labels[:, 1:], as its own patch calls
    it) in place of fs.linear_cross_entropy in fastsoftmax's patched forward: the decoder and everything
    else as in the fastsoftmax variant, only the loss differs. (This process only.)"""
    from fastsoftmax.integrations import transformers as fst

    def loss(hidden, head, labels, **options):
        if any(v is not None for k, v in options.items() if k in ("softcap", "num_items_in_batch", "shift_labels")):
            raise NotImplementedError(f"the CCE variant takes labels alone, not {options}")
        return cce_loss(hidden, head.weight, labels, shift=True, reduction="mean")

    fst.causal_lm_loss = loss
    return fst.apply(model)


def _versions() -> dict:
    import torch
    import transformers

    import fastsoftmax

    out = dict(torch=torch.__version__, transformers=transformers.__version__, fastsoftmax=fastsoftmax.__version__)
    from importlib.metadata import PackageNotFoundError, version

    for name in ("triton", "liger-kernel", "cut-cross-entropy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_variant(variant: str, batch: int, seq: int, args) -> dict:
    """One variant at one batch shape (rows of tokens): the record for the JSON."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (use --tiny on the CPU)")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(TINY if args.tiny else LLAMA_1B), attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = _patch(variant, model, batch * seq).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
    labels = ids.clone()

    def step():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    losses = [step().item() for _ in range(args.warmup)]
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    ms = statistics.median(times) * 1e3
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    split = _peak_split(step, device) if variant.startswith("fastsoftmax") or variant == "cce" else None
    return dict(
        variant=variant,
        seq=seq,
        batch=batch,
        params=params,
        ms=ms,
        tokens_per_s=batch * seq / (ms / 1e3),
        peak_bytes=peak,
        peak_split=split,
        note=getattr(model, "train_step_note", None),
        step_ms=[t * 1e3 for t in times],
        losses=losses,
    )


def _peak_split(step, device: str) -> dict | None:
    """One more step (untimed) with the patched forward's loss wrapped: the step's peak split into the forward
    up to the loss (at_loss: what is allocated as it starts, the activations held for the backward included),
    the loss itself (the LM head's forward, and with it its gradients for a scalar loss), and the rest (the
    backward and the optimizer). Bytes; None on the CPU."""
    if device != "cuda":
        step()
        return None
    import torch

    from fastsoftmax.integrations import transformers as fst

    inner, seen = fst.causal_lm_loss, {}

    def probed(*args, **kwargs):
        seen["before_loss"], seen["at_loss"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = inner(*args, **kwargs)
        seen["loss"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return out

    fst.causal_lm_loss = probed
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        seen["after_loss"] = torch.cuda.max_memory_allocated()
    finally:
        fst.causal_lm_loss = inner
    return seen


# ---- the driver --------------------------------------------------------------------------------------------


def _summary(records: list[dict]) -> list[dict]:
    """Per batch shape: the fastest of the four, the lowest peak, and whether fastsoftmax meets the target
    (fastest, peak at most 1.01x the lowest)."""
    out = []
    for batch, seq in sorted({(r["batch"], r["seq"]) for r in records}):
        ran = [r for r in records if (r["batch"], r["seq"]) == (batch, seq)]
        ran = [r for r in ran if r["variant"] in FOUR and "tokens_per_s" in r]
        ours = next((r for r in ran if r["variant"] == "fastsoftmax"), None)
        if not ran or ours is None:
            continue
        fastest = max(ran, key=lambda r: r["tokens_per_s"])
        peaks = [r["peak_bytes"] for r in ran if r["peak_bytes"] is not None]
        low = min(peaks) if peaks else None
        out.append(
            dict(
                batch=batch,
                seq=seq,
                compared=[r["variant"] for r in ran],
                fastest=fastest["variant"],
                lowest_peak=min(ran, key=lambda r: r["peak_bytes"] or 0)["variant"] if peaks else None,
                fastsoftmax_vs_fastest=ours["tokens_per_s"] / fastest["tokens_per_s"],
                fastsoftmax_peak_vs_lowest=ours["peak_bytes"] / low if low else None,
                target_met=fastest is ours and (low is None or ours["peak_bytes"] <= 1.01 * low),
            )
        )
    return out


def _environment(args) -> dict:
    env = dict(python=platform.python_version(), argv=sys.argv[1:], date=time.strftime("%Y-%m-%d"))
    try:
        git = ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"]
        env["commit"] = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = None
    if not args.tiny:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
    return env


def _merge(out: str, parts: list[str]) -> int:
    """One file from runs of the same tree and versions (one per batch shape: each fits a device call),
    their records in order and the summary made again; each part's environment is kept."""
    docs = [json.load(open(p)) for p in parts]
    if any((d["model"], d["versions"]) != (docs[0]["model"], docs[0]["versions"]) for d in docs):
        raise SystemExit("train_step: the parts differ in model or versions")
    records = [r for d in docs for r in d["records"]]
    result = dict(
        what=docs[0]["what"],
        model=docs[0]["model"],
        environment=docs[0]["environment"],
        parts=[d["environment"] for d in docs],
        versions=docs[0]["versions"],
        records=records,
        summary=_summary(records),
    )
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for line in result["summary"]:
        print(json.dumps(line))
    return 0


def _shape(text: str) -> tuple[int, int]:
    """'8x1024' -> (8, 1024): rows of tokens."""
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"train_step: a shape is ROWSxTOKENS (8x1024), got {text!r}") from None
    if batch < 1:
        raise SystemExit(f"train_step: at least one row, got {text!r}")
    return batch, seq


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        variant, shape = args.worker.split(":")
        batch, seq = _shape(shape)
        print(json.dumps(run_variant(variant, batch, seq, args)))
        return 0
    if args.merge:
        return _merge(args.out, args.merge)
    shapes = [_shape(v) for v in args.shapes]
    if args.steps < 1 or args.warmup < 0 or min(s for _, s in shapes) < 2:
        raise SystemExit("train_step: --steps at least 1, --warmup at least 0, at least 2 tokens a row")
    common = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    common += ["--tiny"] if args.tiny else []
    records: list[dict] = []
    head = dict(
        what="one training step (forward, backward, AdamW), bf16, random init, Llama-3.2-1B shape"
        + (" (--tiny: CPU, 2 layers)" if args.tiny else ""),
        model=TINY if args.tiny else LLAMA_1B,
        environment=_environment(args),
        versions=_versions(),
    )
    result = _write(args.out, head, records)
    for batch, seq in shapes:
        for variant in args.variants:
            cmd = [sys.executable, os.path.abspath(__file__), args.out, *common, "--worker", f"{variant}:{batch}x{seq}"]
            t0 = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rec = dict(variant=variant, batch=batch, seq=seq, skipped=f"timed out after {args.timeout} s")
            else:
                if done.returncode == 0:
                    rec = json.loads(done.stdout.strip().splitlines()[-1])
                else:
                    tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
                    rec = dict(
                        variant=variant, batch=batch, seq=seq, skipped=f"exit {done.returncode}: {tail[0][:300]}"
                    )
            rec["wall_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps({k: v for k, v in rec.items() if k not in ("step_ms", "losses")}), flush=True)
            records.append(rec)
            result = _write(args.out, head, records)  # (after every variant: a run cut short keeps what ran)
    for line in result["summary"]:
        print(json.dumps(line))
    return 0


def _write(out: str, head: dict, records: list[dict]) -> dict:
    result = head | dict(records=records, summary=_summary(records))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
