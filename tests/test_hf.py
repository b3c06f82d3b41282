"""fastsoftmax.integrations.transformers against the unpatched model, on tiny randomly initialised models of each
supported family built from configs (2 layers, hidden 64, vocabulary 301, 17 tokens; no download): the loss,
every parameter's gradient (tied embeddings included) and the outputs equal the model's own forward with
padding and ignored labels, num_items_in_batch, shift_labels, Gemma's softcaps, an LM-head bias, gradient
checkpointing; logits wherever they are asked for; the attention path against eager attention (and sdpa where
eager and sdpa differ: query rows that see no key), with padding, sliding windows and Gemma 2's attention
softcap, and which mask reached fs.softmax; apply/revert/patched exactly undone; what is refused. The longest
cases (20 AdamW steps, the Trainer, torch.compile, the full family matrix of the attention path) run with
--full (tests/conftest.py's FULL_ONLY). The gpu-marked tests at the end run bf16 models on a GPU (Triton
kernels) against a float64 reference.

Tolerances: the models are fp32, as is the unpatched loss (transformers upcasts the logits), so the two
differ by fp32 rounding: the loss to 1e-5 relative, each gradient to 1e-4 of its own largest entry. A wrong
shift, softcap, mask or reduction moves them by 1e-2 or more (each was tried).

transformers is imported on first use, not at collection: importing it costs ~8 s of a 2-core CPU, which
every xdist worker would pay while collecting even when these tests are deselected."""

import importlib.util
import inspect
import types

import pytest
import torch

import fastsoftmax

if importlib.util.find_spec("transformers") is None:  # (the test extra installs it: this is only a guard)
    pytest.skip("transformers is not installed; pip install -e '.[test]'", allow_module_level=True)


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


# ---- the loss ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_match_unpatched(family, device, monkeypatch):
    model = make_model(family, device)
    inputs = batch(device)
    want, want_g = step(model, inputs)
    calls = Calls(monkeypatch)
    fst().apply(model)
    got, got_g = step(model, inputs)
    assert len(calls.lce) == 1 and calls.lce[0]["reduction"] == "mean"
    assert calls.lce[0]["softcap"] == getattr(model.config, "final_logit_softcapping", None)
    assert type(got) is type(want) and got.logits is None and want.logits.shape == (2, S, V)
    assert got.loss.dtype == torch.float32
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
    fst().revert(model)


def assert_patched_matches(model, inputs):
    """One training step of model on inputs, patched (fst.patched) and not: equal loss and gradients."""
    want, want_g = step(model, inputs)
    with fst().patched(model):
        got, got_g = step(model, inputs)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)


def test_tied_embeddings_and_head_bias(device):
    model = make_model("gemma", device)
    head, emb = model.lm_head.weight, model.get_input_embeddings().weight
    assert head is emb  # (tied: one parameter, whose gradient has both uses)
    inputs = batch(device)
    assert_patched_matches(model, inputs)

    model = make_model("llama", device)
    model.lm_head = torch.nn.Linear(D, V, bias=True, device=device)
    torch.nn.init.normal_(model.lm_head.bias, std=1.0)
    assert_patched_matches(model, inputs)


def test_num_items_in_batch_and_shift_labels(device, monkeypatch):
    """The Trainer's gradient accumulation passes num_items_in_batch (sum / n, a tensor or an int); a
    shift_labels keyword replaces the shift; ignore_index= another ignored value."""
    model = make_model("llama", device)
    inputs = batch(device)
    n = torch.tensor(37, device=device)
    shifted = torch.nn.functional.pad(inputs["labels"][:, 2:], (0, 2), value=-100)  # (the next-but-one token)
    relabelled = {**inputs, "labels": inputs["labels"].masked_fill(inputs["labels"] == -100, -1)}
    cases = [
        (inputs, {"num_items_in_batch": n}),
        (inputs, {"num_items_in_batch": 37}),
        (inputs, {"shift_labels": shifted}),
        (relabelled, {"ignore_index": -1}),
    ]
    wants = [step(model, i, **kw) for i, kw in cases]
    calls = Calls(monkeypatch)
    fst().apply(model)
    for (i, kw), (want, want_g) in zip(cases, wants, strict=True):
        got, got_g = step(model, i, **kw)
        assert_loss_close(got.loss, want.loss)
        assert_grads_close(got_g, want_g)
    assert [c["reduction"] for c in calls.lce] == ["sum", "sum", "mean", "mean"]
    assert calls.lce[3]["ignore_index"] == -1


def test_gradient_checkpointing(device):
    model = make_model("qwen3", device)
    model.gradient_checkpointing_enable()
    inputs = batch(device)
    assert_patched_matches(model, inputs)


def test_logits_wherever_asked(device, monkeypatch):
    """No labels, eval mode or return_logits=True: the model's own forward (logits, and its loss); labels in
    eval with return_logits=False: the fused loss."""
    model = make_model("gemma2", device)
    inputs = batch(device)
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    want_train = step(model, inputs)[0]
    model.eval()
    with torch.no_grad():
        want_eval = model(**inputs)
        want_nolabels = model(**no_labels)
    calls = Calls(monkeypatch)
    fst().apply(model)
    with torch.no_grad():
        got_eval = model(**inputs)
        got_nolabels = model(**no_labels)
        got_fused = model(**inputs, return_logits=False)
    assert len(calls.lce) == 1 and got_fused.logits is None
    torch.testing.assert_close(got_eval.logits, want_eval.logits, rtol=0, atol=0)
    torch.testing.assert_close(got_eval.loss, want_eval.loss, rtol=0, atol=0)
    torch.testing.assert_close(got_nolabels.logits, want_nolabels.logits, rtol=0, atol=0)
    assert_loss_close(got_fused.loss, want_eval.loss)
    model.train()
    got_train = step(model, inputs, return_logits=True)[0]
    assert len(calls.lce) == 1
    torch.testing.assert_close(got_train.logits, want_train.logits, rtol=0, atol=0)


def test_return_dict_positional_and_outputs(device):
    """return_dict=False gives the output's tuple; positional arguments are named as the class's forward
    names them; hidden_states come through; the signature the Trainer reads is the class's."""
    model = make_model("gpt2", device)
    inputs = batch(device)
    want, want_g = step(model, inputs, output_hidden_states=True)
    fst().apply(model)
    own = inspect.signature(type(model).forward).parameters
    assert list(inspect.signature(model.forward).parameters) == list(own)[1:]
    got, got_g = step(model, inputs, output_hidden_states=True)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    names = list(own)[1:]
    positional = [inputs.get(name) for name in names[: names.index("attention_mask") + 1]]
    torch.manual_seed(0)
    tup = model(*positional, labels=inputs["labels"], return_dict=False)
    assert isinstance(tup, tuple) and tup[0].dim() == 0
    assert_loss_close(tup[0], want.loss)
    with pytest.raises(TypeError, match="multiple values"):
        model(inputs["input_ids"], input_ids=inputs["input_ids"], labels=inputs["labels"])


def test_revert_restores_exactly(device):
    model = make_model("mistral", device, attn="eager")
    other = make_model("mistral", device, attn="eager")
    before = dict(vars(model))
    module = fst()
    module.apply(model, attention_softmax=True)
    assert model.forward.__func__ is not type(model).forward
    assert model.config._attn_implementation == "fastsoftmax" and other.config._attn_implementation == "eager"
    assert "forward" not in vars(other)  # (the instance, not the class)
    module.revert(model)
    assert vars(model).keys() == before.keys() and "forward" not in vars(model)
    assert model.forward.__func__ is type(model).forward
    assert model.config._attn_implementation == "eager"
    with module.patched(model, attention_softmax=True):
        assert model.config._attn_implementation == "fastsoftmax" and "forward" in vars(model)
    assert vars(model).keys() == before.keys() and model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="not patched"):
        module.revert(model)


def test_revert_under_a_later_wrapper(device, monkeypatch):
    """A wrapper set on the instance after apply() (accelerate's prepare() does that) keeps our function;
    revert() says so, and the function then calls the model's own forward."""
    model = make_model("llama", device)
    inputs = batch(device)
    want, want_g = step(model, inputs)
    fst().apply(model)
    inner = model.forward.__func__
    model.forward = types.MethodType(lambda self, *a, **k: inner(self, *a, **k), model)
    calls = Calls(monkeypatch)
    with pytest.warns(UserWarning, match="wrapped after apply"):
        fst().revert(model)
    got, got_g = step(model, inputs)
    assert not calls.lce and got.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    assert_grads_close(got_g, want_g)


def test_refused_with_a_clear_error(device):
    T, module = hf(), fst()
    with pytest.raises(TypeError, match="LlamaForCausalLM, MistralForCausalLM"):
        module.apply(torch.nn.Linear(2, 2))
    bert = T.BertForMaskedLM(T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(TypeError, match="BertForMaskedLM is not a supported causal LM"):
        module.apply(bert)

    class Custom(T.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with pytest.raises(TypeError, match="overrides LlamaForCausalLM.forward"):
        module.apply(Custom(make_model("llama").config))
    model = make_model("llama", device)
    module.apply(model)
    with pytest.raises(ValueError, match="already applied"):
        module.apply(model)
    module.revert(model)
    with pytest.raises(ValueError, match="runs 'sdpa' attention"):
        module.apply(model, attention_softmax=True)
    with pytest.raises(ValueError, match="nothing to apply"):
        module.apply(model, loss=False)
    model.loss_function = lambda *a, **k: None
    with pytest.raises(ValueError, match="not transformers' ForCausalLMLoss"):
        module.apply(model)
    model = make_model("llama", device)
    model.forward = model.forward  # (a wrapper on the instance, as accelerate's prepare() sets)
    with pytest.raises(ValueError, match="already replaced on this instance"):
        module.apply(model)
    assert "_fastsoftmax_patch" not in vars(model)


# ---- attention ---------------------------------------------------------------------------------------------

ATTENTION_FULL = ["llama", "qwen2", "qwen3", "gemma", "gemma3", "gpt2"]


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


# ---- training: AdamW steps, the Trainer, torch.compile (--full) --------------------------------------------


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
