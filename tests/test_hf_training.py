"""Training through fastsoftmax.integrations.transformers' patch (loss and attention) on tiny models
(tests/hf_models.py): 20 AdamW steps' loss curves, one Trainer step over accumulated batches, torch.compile
(fullgraph) of the patched model; on a GPU, bf16 models on the Triton kernels against a float64 reference."""

import importlib.util

import pytest
import torch
from hf_models import (
    FAMILIES,
    Calls,
    assert_grads_close,
    assert_loss_close,
    batch,
    fst,
    hf,
    make_model,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread in this module)
    step,
)

if importlib.util.find_spec("transformers") is None:  # (the test extra installs it: this is only a guard)
    pytest.skip("transformers is not installed; pip install -e '.[test]'", allow_module_level=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_adamw_loss_curves(family, device):
    """20 AdamW steps on two alternating batches with and without the patch (loss and attention): the loss
    curves match. (Not every weight: AdamW normalises a gradient that is zero but for rounding, as the key
    bias's, into full steps in a direction the rounding picks.)"""
    curves = []
    for patched in (False, True):
        model = make_model(family, device, attn="eager")
        if patched:
            fst().apply(model, attention_softmax=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for i in range(20):
            torch.manual_seed(i)
            loss = model(**batch(device, seed=i % 2)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curves.append(torch.tensor(losses))
    assert curves[0][-1] < curves[0][0] - 0.5  # (it learns: the curves compared are not flat)
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-4, atol=0)


def test_trainer_step(device, tmp_path, monkeypatch):
    """One Trainer step over two accumulated batches (its num_items_in_batch reaches the loss) gives the
    unpatched model's loss and weights. (SGD: Adam's first step is lr times the gradient's sign, which rounding
    picks where the gradient is zero but for rounding.)"""
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate (the test extra installs it)")
    T = hf()
    data = [{k: v[0].cpu() for k, v in batch(seed=s).items()} for s in range(4)]
    results = []
    for patched in (False, True):
        model = make_model("llama", device)
        calls = Calls(monkeypatch)
        if patched:
            fst().apply(model)
        args = T.TrainingArguments(
            output_dir=str(tmp_path / str(patched)),
            max_steps=1,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-1,
            optim="sgd",
            report_to=[],
            save_strategy="no",
            use_cpu=device == "cpu",
            dataloader_num_workers=0,
            seed=0,
        )
        out = T.Trainer(model=model, args=args, train_dataset=data).train()
        results.append((out.training_loss, torch.cat([p.detach().flatten() for p in model.parameters()])))
        assert [c["reduction"] for c in calls.lce] == (["sum", "sum"] if patched else [])
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_torch_compile(family, device):
    """torch.compile(fullgraph=True) of the patched model (loss and attention): one graph, the eager
    patched model's loss and gradients."""
    model = make_model(family, device, attn="eager")
    inputs = batch(device)
    want, want_g = step(model, inputs)
    fst().apply(model, attention_softmax=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got, got_g = step(compiled, inputs)
    assert got.logits is None
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)


# ---- on a GPU: bf16 models, the Triton kernels ---------------------------------------------------------------


def _error(got, ref):
    """The largest error over the tensors, each relative to its reference's largest entry."""
    pairs = zip(got, ref, strict=True)
    return max((a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in pairs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bf16_matches_unpatched(family):
    """A bf16 model on the GPU, patched (loss and attention; backend auto: the Triton kernels) and unpatched,
    each against the same model in float64 unpatched: the patched model's error in the loss and in every
    gradient at most twice the unpatched bf16 model's plus 1e-2 (relative to the largest entry)."""
    inputs = batch("cuda", n_pad=2)  # (every query sees a key: float64 eager gives NaN on a row that sees none)
    off = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else {}  # (RNG per dtype)
    off.update(attention_dropout=0.0) if family == "mistral" else None
    ref_model = make_model(family, "cuda", torch.float64, attn="eager", **off)
    ref, ref_g = step(ref_model, inputs)
    errors = []
    for patched in (False, True):
        model = make_model(family, "cuda", torch.bfloat16, attn="eager", **off)
        if patched:
            fst().apply(model, attention_softmax=True)
        got, got_g = step(model, inputs)
        assert got.loss.dtype == torch.float32
        errors.append((abs(got.loss.item() - ref.loss.item()) / ref.loss.item(), _error(got_g, ref_g)))
    (loss0, grad0), (loss1, grad1) = errors
    assert loss1 <= 2 * loss0 + 1e-2, errors
    assert grad1 <= 2 * grad0 + 1e-2, errors
