"""fastsoftmax.integrations.transformers' attention path (attention_softmax=True) against eager attention on
tiny models (tests/hf_models.py): outputs, loss and gradients with padding, sliding windows and Gemma 2's
attention softcap, and which mask reached fs.softmax; sdpa where eager and sdpa differ (query rows that see
no key); no mask over a longer static cache; greedy generation with the KV cache; attn_implementation=
"fastsoftmax" by name; sinks refused."""

import importlib.util

import pytest
import torch
from hf_models import (
    Calls,
    assert_grads_close,
    assert_loss_close,
    batch,
    fst,
    make_model,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread in this module)
    step,
)

if importlib.util.find_spec("transformers") is None:  # (the test extra installs it: this is only a guard)
    pytest.skip("transformers is not installed; pip install -e '.[test]'", allow_module_level=True)


ATTENTION_FULL = ["llama", "qwen2", "qwen3", "gemma", "gemma3", "gpt2"]


def test_left_padding_training_loss_is_sdpas(device):
    """Left padding in training with attention_softmax=True: the loss and gradients are sdpa's (the last pad
    position, whose query sees no key, predicts the first real token: zeros there, where eager averages the
    values); with that one label masked they are eager's too. What apply()'s docstring and the README say."""
    inputs = batch(device, pad="left")
    model = fst().apply(make_model("llama", device, attn="eager"), attention_softmax=True)
    eager, sdpa = make_model("llama", device, attn="eager"), make_model("llama", device, attn="sdpa")
    got, got_g = step(model, inputs)
    want, want_g = step(sdpa, inputs)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
    assert abs(step(eager, inputs)[0].loss.item() - got.loss.item()) > 1e-5  # (eager's differs here)
    masked = dict(inputs, labels=inputs["labels"].clone())
    masked["labels"][1, 5] = -100  # (the first real token of the left-padded row: n_pad = 5)
    got, got_g = step(model, masked)
    want, want_g = step(eager, masked)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)


@pytest.mark.parametrize("family", ["mistral", "gemma2", *ATTENTION_FULL])
def test_attention_matches_eager(family, device, monkeypatch):
    """Outputs at kept positions, loss and gradients equal eager attention's, with and without padding: no
    padding and no window reaches fs.softmax as causal=True with no mask, padding or a window as sdpa's
    boolean mask."""
    model = make_model(family, device, attn="eager")
    cases = [batch(device, pad="right"), batch(device, pad="none")]
    wants = [step(model, inputs, output_attentions=True) for inputs in cases]
    calls = Calls(monkeypatch)
    fst().apply(model, loss=False, attention_softmax=True)
    for inputs, (want, want_g) in zip(cases, wants, strict=True):
        got, got_g = step(model, inputs, output_attentions=True)
        keep = inputs["attention_mask"].bool()
        torch.testing.assert_close(got.logits[keep], want.logits[keep], rtol=1e-4, atol=1e-4)
        assert got.attentions[0].dtype == want.attentions[0].dtype
        assert_loss_close(got.loss, want.loss)
        assert_grads_close(got_g, want_g)
    assert ("bool", False) in calls.softmax
    assert (("none", True) in calls.softmax) == (family != "mistral")  # (Mistral: every layer windowed)
    assert set(calls.softmax) <= {("bool", False), ("none", True)}, calls.softmax


def test_attention_query_rows_seeing_no_key_match_sdpa(device):
    """Left padding: a padded query sees no key. Eager averages the values there (its mask is finite), sdpa
    and fs.softmax give zeros; every other output matches eager's, and all of them sdpa's."""
    inputs = batch(device, pad="left")
    eager, sdpa = make_model("mistral", device, attn="eager"), make_model("mistral", device, attn="sdpa")
    model = fst().apply(make_model("mistral", device, attn="eager"), loss=False, attention_softmax=True)
    with torch.no_grad():
        got, want_eager, want_sdpa = (m.eval()(**inputs).logits for m in (model, eager, sdpa))
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want_eager[keep], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want_sdpa, rtol=1e-4, atol=1e-4)
    assert (got[~keep] - want_eager[~keep]).abs().max() > 1e-2  # (the rows that see no key do differ)


def test_generate_matches_eager(device, monkeypatch):
    """Greedy generation with the KV cache (prefill, then one query a step: no mask and not causal without
    padding in a full-attention layer, the boolean mask with padding or a window) gives eager attention's
    tokens."""
    eager = make_model("gemma2", device, attn="eager").eval()
    model = fst().apply(make_model("gemma2", device, attn="eager").eval(), attention_softmax=True)
    calls = Calls(monkeypatch)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    for pad in ("left", "none"):
        inputs = {k: v for k, v in batch(device, pad=pad).items() if k != "labels"}
        torch.testing.assert_close(model.generate(**inputs, **options), eager.generate(**inputs, **options))
    assert {("bool", False), ("none", False)} <= set(calls.softmax)


def test_attention_without_a_mask_over_a_longer_static_cache(device):
    """No mask, causal, more key slots than queries (a static cache's prefill, should transformers pass no
    mask): the queries see the first Sq keys bottom-right aligned, as sdpa's is_causal does, and never the
    later slots (NaN here: empty); scaling None is the head dim's -1/2 power, and GQA heads repeat."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g).to(device)
    k, v = (torch.randn(2, 2, 9, 8, generator=g).to(device) for _ in range(2))
    k[:, :, 5:], v[:, :, 5:] = float("nan"), float("nan")
    out, probs = fst().attention_forward(module, q, k, v, None)
    rk, rv = (t[:, :, :5].repeat_interleave(2, 1).double() for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), rk, rv, is_causal=True)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-6)  # (fp32 against fp64)
    assert probs.shape == (2, 4, 5, 5) and (probs.triu(1) == 0).all()


def test_attention_refuses_sinks(device):
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.zeros(4))
    q = torch.randn(1, 4, 3, 8, device=device)
    with pytest.raises(NotImplementedError, match="sinks"):
        fst().attention_forward(module, q, q, q, None)
    with pytest.raises(NotImplementedError, match="position_bias"):
        fst().attention_forward(torch.nn.Module(), q, q, q, None, position_bias=q)


def test_attn_implementation_by_name(device):
    """register() makes attn_implementation="fastsoftmax" a name transformers accepts at construction."""
    fst().register()
    model = make_model("qwen2", device, attn="fastsoftmax")
    eager = make_model("qwen2", device, attn="eager")
    inputs = batch(device)
    got, got_g = step(model, inputs)
    want, want_g = step(eager, inputs)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
