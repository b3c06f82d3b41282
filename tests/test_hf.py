"""fastsoftmax.integrations.transformers' loss against the unpatched model, on tiny randomly initialised models
of each supported family (tests/hf_models.py): the loss, every parameter's gradient (tied embeddings
included) and the outputs equal the model's own forward with padding and ignored labels, num_items_in_batch,
shift_labels, Gemma's softcaps, an LM-head bias, gradient checkpointing; logits wherever they are asked for;
apply/revert/patched exactly undone; what is refused. The attention path: test_hf_attention.py; training
and the GPU: test_hf_training.py. All of them run with --full (tests/conftest.py's FULL_ONLY)."""

import importlib
import importlib.util
import inspect
import types

import pytest
import torch
from hf_models import (
    FAMILIES,
    Calls,
    D,
    S,
    V,
    assert_grads_close,
    assert_loss_close,
    assert_patched_matches,
    batch,
    fst,
    hf,
    make_model,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread in this module)
    step,
)

if importlib.util.find_spec("transformers") is None:  # (the test extra installs it: this is only a guard)
    pytest.skip("transformers is not installed; pip install -e '.[test]'", allow_module_level=True)


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


def test_a_float64_models_loss_is_fp32(device):
    """transformers casts the logits to fp32, so its loss is fp32 for a float64 model too; the patched loss
    was float64. Now fp32 (computed in float64, rounded once), and the gradients float64's, closer to exact
    than the unpatched model's, whose loss math is fp32."""
    model = make_model("llama", device, dtype=torch.float64)
    inputs = batch(device)
    want, want_g = step(model, inputs)
    with fst().patched(model):
        got, got_g = step(model, inputs)
    assert got.loss.dtype == want.loss.dtype == torch.float32
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
    with module.patched(model, attention_softmax=True, memory=1 << 20):  # (every option apply takes)
        assert model.config._attn_implementation == "fastsoftmax" and "forward" in vars(model)
    assert vars(model).keys() == before.keys() and model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="not patched"):
        module.revert(model)


def test_a_patched_model_pickles_and_copies_patched(device, monkeypatch):
    """pickle (torch.save of a whole model) and copy.deepcopy keep the patch: the copy's training step takes
    the fused loss and matches the unpatched model; the copy reverts on its own, the original stays patched."""
    import copy
    import pickle

    model = make_model("llama", device)
    inputs = batch(device)
    want, want_g = step(make_model("llama", device), inputs)
    fst().apply(model, attention_softmax=False)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        calls = Calls(monkeypatch)
        got, got_g = step(clone, inputs)
        assert len(calls.lce) == 1 and got.logits is None
        assert_loss_close(got.loss, want.loss)
        assert_grads_close(got_g, want_g)
        assert clone.forward.__self__ is clone
        assert inspect.signature(clone.forward) == inspect.signature(model.forward)
        fst().revert(clone)
        assert "forward" not in vars(clone) and "forward" in vars(model)
    fst().revert(model)


def test_patched_forward_reads_as_the_method_and_a_shallow_copy_reverts(device):
    """model.forward after apply() keeps the method's name, docstring and signature (help(), the Trainer);
    revert() of a shallow copy (whose forward is the original's, bound to it) removes the copy's forward
    without a warning, and the copy then runs its class's forward; the original stays patched."""
    import copy
    import warnings

    model = make_model("llama", device)
    cls = type(model)
    fst().apply(model)
    assert model.forward.__name__ == "forward" and model.forward.__doc__ == cls.forward.__doc__
    assert list(inspect.signature(model.forward).parameters)[0] != "self"
    assert model.forward.__self__ is model and not inspect.ismethod(model.forward)  # (documented: semantics.md)
    clone = copy.copy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fst().revert(clone)
    assert "forward" not in vars(clone) and clone.forward.__func__ is cls.forward
    assert "forward" in vars(model)
    fst().revert(model)


def test_data_parallel_replicas_run_their_own_weights(device, monkeypatch):
    """nn.DataParallel's replicate() (which the Trainer applies on several GPUs without torchrun) copies each
    module's __dict__: a patched replica ran the original model's forward, its weights on the replica's
    inputs. Here replicate() runs on the CPU, its broadcast making scaled copies (as another device's weights
    would differ): the patched replica's loss is the unpatched replica's, through the fused loss, and
    revert() leaves nothing of the hook."""
    rep = importlib.import_module("torch.nn.parallel.replicate")  # (the package's name for it is the function)

    monkeypatch.setattr(rep, "_get_device_index", lambda d, optional=False: d)

    def scaled(tensors, devices, detach=False):  # (one copy of every tensor per "device")
        return [[t.detach() * 0.5 if detach else t * 0.5 for t in tensors] for _ in devices]

    monkeypatch.setattr(rep, "_broadcast_coalesced_reshape", scaled)
    inputs = batch(device)
    with torch.no_grad():
        want = rep.replicate(make_model("llama", device), [0, 1])[1](**inputs).loss
        model = fst().apply(make_model("llama", device))
        original = model(**inputs).loss
        replica = rep.replicate(model, [0, 1])[1]
        calls = Calls(monkeypatch)
        got = replica(**inputs)
    assert replica.forward.__self__ is replica and len(calls.lce) == 1 and got.logits is None
    assert_loss_close(got.loss, want)
    assert not torch.allclose(got.loss, original)  # (the replica's weights differ from the model's)
    fst().revert(model)
    assert "_replicate_for_data_parallel" not in vars(model) and "forward" not in vars(model)


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
    model = make_model("llama", device)
    with pytest.raises(TypeError, match="loss and attention_softmax must be bools"):
        module.apply(model, loss=1)
    model.lm_head = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(D, V, device=device))
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):  # (a subclass made by parametrization)
        module.apply(model)
    model = module.apply(make_model("llama", device))
    with pytest.raises(TypeError, match="positional arguments but"):  # (as the unpatched forward's TypeError)
        model(*[None] * 40)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_softcap_only_where_the_family_applies_it(family, device, monkeypatch):
    """A config that carries final_logit_softcapping (transformers keeps any extra key of a config.json) gets
    the cap from the patch only where the family's own forward applies it (Gemma 2 and 3): a Llama config
    with cap 2 gives the unpatched Llama's loss and gradients, uncapped. SOFTCAPPED names the families, and
    each supported class's forward is read to check it."""
    import inspect as _inspect

    model = make_model(family, device, final_logit_softcapping=2.0)
    assert model.config.final_logit_softcapping == 2.0
    inputs = batch(device)
    want, want_g = step(model, inputs)
    calls = Calls(monkeypatch)
    fst().apply(model)
    got, got_g = step(model, inputs)
    assert calls.lce[0]["softcap"] == (2.0 if family == "gemma2" else None)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
    fst().revert(model)
    T = hf()
    for name in fst().SUPPORTED:
        reads = "final_logit_softcapping" in _inspect.getsource(getattr(T, name).forward)
        assert reads == (name in fst().SOFTCAPPED), name


def test_return_dict_false_keeps_the_tuples_positions(device):
    """return_dict=False: (loss, logits, ...) in transformers' positions, logits None where the patch makes
    none, so that ``loss, logits = out[:2]`` unpacks as it does unpatched and the cache stays third."""
    model = make_model("llama", device)
    inputs = batch(device)
    model.train()
    torch.manual_seed(0)
    want = model(**inputs, return_dict=False, use_cache=True)
    fst().apply(model)
    torch.manual_seed(0)
    got = model(**inputs, return_dict=False, use_cache=True)
    assert len(got) == len(want) and got[1] is None and want[1] is not None
    assert_loss_close(got[0], want[0])
    assert type(got[2]) is type(want[2])
    fst().revert(model)


def test_memory_reaches_the_loss(device, monkeypatch):
    """apply(model, memory=) is the loss's fs.linear_cross_entropy memory=: passed on each call (the plan's
    chunks follow it), the loss and gradients still the unpatched model's; a bad budget, or a budget without
    the loss, is refused before the model is touched."""
    from fastsoftmax import heuristics
    from fastsoftmax.heuristics import lm_head as lm_rules

    model = make_model("llama", device)
    inputs = batch(device)
    want, want_g = step(model, inputs)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="memory must be None or a positive int"):
            fst().apply(model, memory=bad)
    with pytest.raises(ValueError, match="memory= is the loss's"):
        fst().apply(model, loss=False, attention_softmax=True, memory=1 << 20)
    assert "_fastsoftmax_patch" not in vars(model)
    calls = Calls(monkeypatch)
    memory = 3 * V * 4  # 3 rows of fp32 logits a chunk (lce_fused's few launches priced as lce_sliced's: row
    monkeypatch.setattr(lm_rules, "HOST_FUSED_TILE_S", lm_rules.HOST_TILE_S)  # chunks, not tiles)
    fst().apply(model, memory=memory)
    got, got_g = step(model, inputs)
    assert [c["memory"] for c in calls.lce] == [memory]
    plan = heuristics.last_plan()
    assert plan.rows == 3 and plan.splits == -(-2 * S // 3), plan  # (2 rows of S tokens)
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
    fst().revert(model)


def test_default_memory_is_the_heads_gradient_share(device, monkeypatch):
    """apply(model) without memory= gives the loss the head's gradient bytes / STEP_SHARE (the step's rule,
    from the head's weight at the call), the plan's chunks following it."""
    from fastsoftmax import heuristics
    from fastsoftmax.heuristics import lm_head as lm_rules

    model = make_model("llama", device)
    inputs = batch(device)
    want, want_g = step(model, inputs)
    calls = Calls(monkeypatch)
    fst().apply(model)
    got, got_g = step(model, inputs)
    weight = model.lm_head.weight
    budget = weight.numel() * weight.element_size() // lm_rules.STEP_SHARE
    assert [c["memory"] for c in calls.lce] == [budget]
    plan = heuristics.last_plan()
    assert plan.path in ("lce_sliced", "lce_fused") or plan.rows == budget // (V * weight.element_size()), plan
    assert_loss_close(got.loss, want.loss)
    assert_grads_close(got_g, want_g)
    fst().revert(model)


def test_two_dimensional_logits_to_keep(device):
    """logits_to_keep as (B, P) positions or a (B, S) boolean mask selects hidden states as transformers does
    (its slice_logits_to_keep, where it has one): the loss and gradients match the unpatched model's, and
    positions whose count does not match the labels raise as there (a regression test: the patch indexed
    hidden[:, keep, :], which raised on these and, with B * P == S, returned a loss of the wrong rows)."""
    modeling = pytest.importorskip("transformers.modeling_utils")
    if not hasattr(modeling, "slice_logits_to_keep"):
        pytest.skip("this transformers takes no 2-D logits_to_keep")
    model = make_model("llama", device)
    inputs = batch(device)
    b, s = inputs["input_ids"].shape
    shifted = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[:, 1:]
    pos = torch.stack([torch.arange(0, s, 2)[: s // 2], torch.arange(1, s, 2)[: s // 2]])[:b].to(device)
    mask = torch.zeros(b, s, dtype=torch.bool, device=device)
    mask[0, : s // 2] = True
    mask[-1, s // 3 :] = True
    cases = [
        {"logits_to_keep": pos, "shift_labels": torch.take_along_dim(shifted, pos, 1)},
        {"logits_to_keep": mask, "shift_labels": shifted[mask]},
    ]
    wants = [step(model, inputs, **kw) for kw in cases]
    fst().apply(model)
    for kw, (want, want_g) in zip(cases, wants, strict=True):
        got, got_g = step(model, inputs, **kw)
        assert_loss_close(got.loss, want.loss)
        assert_grads_close(got_g, want_g)
    wrong = torch.stack([torch.arange(0, s // b)] * b).to(device)  # (B * P == S: P rows a sample, not S)
    with pytest.raises(ValueError, match="do not match"):
        step(model, inputs, logits_to_keep=wrong)
