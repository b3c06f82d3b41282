"""Tiny randomly initialised causal LMs of each family fastsoftmax.integrations.transformers supports, built
from configs (2 layers, hidden 64, vocabulary 301, 17 tokens; no download), a padded batch with ignored labels,
one seeded training step, and the comparisons with the unpatched model, for tests/test_hf*.py.

Tolerances: the models are fp32, as is the unpatched loss (transformers upcasts the logits), so the two
differ by fp32 rounding: the loss to 1e-5 relative, each gradient to 1e-4 of its own largest entry. A wrong
shift, softcap, mask or reduction moves them by 1e-2 or more (each was tried).

transformers is imported on first use (hf()), not at collection: importing it costs ~8 s of a 2-core CPU,
which every xdist worker would pay while collecting even when these tests are deselected."""

import pytest
import torch

import fastsoftmax


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread while these tests run: their ops are tiny, and OpenMP's spinning threads in two xdist
    workers on two cores (measured: 20 AdamW steps 0.7 s alone, 50-75 s so) cost more than they share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gpt2"]
V, D, S = 301, 64, 17


def hf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def fst():
    from fastsoftmax.integrations import transformers as module

    return module


def make_model(family, device="cpu", dtype=torch.float32, attn=None, seed=0, **overrides):
    """A tiny randomly initialised causal LM of the family (weights from ``seed``); softcaps small enough to
    matter, sliding windows shorter than the sequence; attn: the attention implementation (None: the
    model's default, sdpa for most, eager for Gemma 2 in transformers 5.24)."""
    T = hf()
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    common.update(num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    config, model = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "mistral": (T.MistralConfig, T.MistralForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM),
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM),
        "gpt2": (T.GPT2Config, T.GPT2LMHeadModel),
    }[family]
    extra = {
        "mistral": dict(sliding_window=5, attention_dropout=0.1),
        "gemma": dict(head_dim=16),
        "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5, final_logit_softcapping=3.0),
        "gemma3": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5, final_logit_softcapping=3.0),
    }.get(family, {})
    if family == "gemma2":
        extra["attn_logit_softcapping"] = 5.0
    if family == "gemma3":
        extra["layer_types"] = ["sliding_attention", "full_attention"]
    if family == "gpt2":  # (GPT-2's dropouts stay on: the tests seed each call alike)
        common = dict(vocab_size=V, n_embd=D, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2)
        common.update(bos_token_id=0, eos_token_id=0)
    cfg = config(**{**common, **extra, **overrides}, **({"attn_implementation": attn} if attn else {}))
    torch.manual_seed(seed)
    return model(cfg).to(device, dtype).train()


def batch(device="cpu", pad="right", seed=1, n_pad=5):
    """input_ids (2, S), attention_mask with row 1 padded (right: its last n_pad tokens; left: its first; none),
    labels: the ids, -100 at the padding and at one more token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, S), generator=g)
    mask = torch.ones_like(ids)
    if pad == "right":
        mask[1, -n_pad:] = 0
    elif pad == "left":
        mask[1, :n_pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 6] = -100
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def step(model, inputs, seed=0, **kw):
    """(output, gradients of the loss for every parameter), the dropout RNG seeded alike for every call."""
    torch.manual_seed(seed)
    out = model(**inputs, **kw)
    return out, torch.autograd.grad(out.loss, list(model.parameters()))


def assert_grads_close(got, want, rel=1e-4):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        scale = b.abs().max().item()
        assert scale > 0, f"parameter {i}: a zero gradient tests nothing"
        torch.testing.assert_close(a, b, rtol=0, atol=rel * scale, msg=lambda m, i=i: f"parameter {i}: {m}")


def assert_loss_close(a, b, rel=1e-5):
    torch.testing.assert_close(a.float(), b.float(), rtol=rel, atol=0)


class Calls:
    """Records fs.linear_cross_entropy and fs.softmax calls that the integration makes (it looks them up on
    the fastsoftmax module at call time)."""

    def __init__(self, monkeypatch):
        self.lce, self.softmax = [], []
        lce, softmax = fastsoftmax.linear_cross_entropy, fastsoftmax.softmax

        def spy_lce(x, w, t, b=None, **kw):
            self.lce.append(kw)
            return lce(x, w, t, b, **kw)

        def spy_softmax(x, *args, **kw):
            m = kw.get("mask")
            self.softmax.append(("none" if m is None else str(m.dtype).removeprefix("torch."), kw.get("causal")))
            return softmax(x, *args, **kw)

        monkeypatch.setattr(fastsoftmax, "linear_cross_entropy", spy_lce)
        monkeypatch.setattr(fastsoftmax, "softmax", spy_softmax)


def assert_patched_matches(model, inputs):
    """One training step of model on inputs, patched (fst.patched) and not: equal loss and gradients."""
    want, want_g = step(model, inputs)
    with fst().patched(model):
        got, got_g = step(model, inputs)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
