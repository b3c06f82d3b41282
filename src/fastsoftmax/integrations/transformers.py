"""fastsoftmax in a Hugging Face causal LM, in one call, on that model instance only.

    from fastsoftmax.integrations import transformers as fst

    fst.apply(model)                          # the loss: fs.linear_cross_entropy, no full logits in training
    fst.apply(model, attention_softmax=True)  # and fs.softmax in attention (a model running eager attention)
    fst.revert(model)                         # the model as it was
    with fst.patched(model): ...              # apply, then revert on exit

The loss (``loss=True``). ``model.forward`` becomes an attribute of the instance (the class, and every other
model in the process, keep theirs). A call takes the fused path when it has ``labels`` and either the model is
in training mode (``model.training``) or it passes ``return_logits=False``: the decoder runs as the
model's own forward runs it, then the loss is ``fs.linear_cross_entropy(final hidden states, lm_head.weight,
shifted labels, lm_head.bias)`` and the output's ``logits`` is None, as the full logits are never built.
Every other call (no labels, eval mode, ``return_logits=True``) is the model's own forward, unchanged:
generation, evaluation and anything that reads logits see the unpatched model. The fused loss keeps
transformers' ForCausalLMLoss semantics:

- labels are shifted inside (the hidden state at t predicts ``labels[..., t + 1]``), or a ``shift_labels=``
  keyword is used as given; ``ignore_index`` is -100 or an ``ignore_index=`` keyword;
- the mean over the kept tokens, or, given ``num_items_in_batch`` (the Trainer's gradient accumulation), the
  sum divided by it;
- ``config.final_logit_softcapping`` is ``softcap=`` for the families whose forward applies it (SOFTCAPPED:
  Gemma 2 and 3; another family's config may carry the key, and is not capped); the head's weight is used
  whatever it is tied to, and its bias if it has one; ``logits_to_keep`` slices the hidden states as it
  slices the logits;
- the loss is fp32, as transformers casts the logits to fp32: a 16-bit model's loss is computed under
  autocast to its own dtype (no cast of any input), for which the library returns an fp32 loss; a float64
  model's in float64, then rounded to fp32 (its gradients keep float64's precision).
The output is the model's own class (CausalLMOutputWithPast, GPT-2's CausalLMOutputWithCrossAttentions) with
past_key_values, hidden_states and attentions from the decoder; ``return_dict=False`` gives its tuple in
transformers' positions: (loss, None for the logits, then the other entries that are not None). Gradient
checkpointing, torch.compile and the Trainer work as before.

Attention (``attention_softmax=True``, or ``attn_implementation="fastsoftmax"`` after ``register()``): eager
attention whose softmax is ``fs.softmax(scores, mask=, scale=, causal=)``, registered with transformers'
AttentionInterface under NAME, and with its AttentionMaskInterface under the same name so that the model
builds sdpa's boolean masks for it (True = keep; padding, sliding windows, packed sequences). Where
transformers skips the mask (no padding, q_len == kv_len), the softmax runs with ``causal=True`` and reads no
mask. Gemma 2's attention softcap is applied in torch before the softmax (tanh(scale * s / cap) * cap). GQA
heads are repeated as eager does; dropout is eager's. Probabilities are computed in fp32 and written in the
query's dtype, as eager's softmax-then-cast. A query row that sees no key (left padding's pad positions)
gives zeros, as sdpa does, where eager averages the values; only outputs at positions no kept token reads
differ. Attention sinks and position-bias tensors are refused.

Refused at apply(), with the reason: a class not in SUPPORTED (or a subclass that overrides its forward), a
custom ``loss_function``, an LM head that is not a plain nn.Linear (quantised, LoRA-wrapped), a model whose
forward is already replaced on the instance, ``attention_softmax=True`` on a model running sdpa, flash or
flex attention (they never build the probabilities; load it with ``attn_implementation="eager"``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
import typing
import warnings

import torch
import torch.nn.functional as F

import fastsoftmax as fs

from ..core import checks
from ..heuristics import lm_head as lm_rules

NAME = "fastsoftmax"  # the attention implementation's name: attn_implementation="fastsoftmax"

# Model classes whose forward is (decoder, final hidden states, lm_head, optional softcap, ForCausalLMLoss):
# the fused forward below reproduces exactly that (tests/test_hf.py checks each against its own forward).
SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GPT2LMHeadModel",
)
# The families whose own forward softcaps the logits by config.final_logit_softcapping: only there does the
# patch pass it on (a config of another family may carry the key, which its forward ignores).
SOFTCAPPED = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MIN_TRANSFORMERS = "5.0"
_STATE = "_fastsoftmax_patch"  # the instance attribute apply() sets and revert() removes
_LOW = (torch.float16, torch.bfloat16)


class _Patch:
    """What apply() changed on one model: the supported class whose forward the instance's forward wraps (or
    None: the loss not patched) with its output class, and the attention implementation before (or None when
    unchanged). Classes and values only: a patched model pickles."""

    def __init__(self, cls: type | None, output: type | None, attention_before: str | None, memory: int | None = None):
        self.cls, self.output, self.attention_before = cls, output, attention_before
        self.memory = memory  # the LM-head loss's memory= (None: lm_rules.step_memory at each call)
        self.keep_rule = _keep_rule() if cls is not None else None


class _Forward:
    """model.forward after apply(): _forward_for(cls) bound to the model as a method, with its signature, that
    pickle and copy.deepcopy rebuild from the model and the class (a method of a function made at run time
    pickles as a lookup of its name on the model, which finds nothing, or the class's forward)."""

    def __init__(self, model, cls: type):
        self.__self__, self.__func__, self._cls = model, _forward_for(cls), cls
        functools.update_wrapper(self, self.__func__, updated=())  # (the method's name, docstring, module)

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return _Forward, (self.__self__, self._cls)

    @property
    def __signature__(self) -> inspect.Signature:  # (inspect.signature reads it: the Trainer's columns)
        return inspect.signature(types.MethodType(self.__func__, self.__self__))


class _Replicate:
    """model._replicate_for_data_parallel after apply(), nn.Module's hook that torch.nn.parallel.replicate
    (nn.DataParallel, which the Trainer applies by itself on several GPUs without torchrun) calls on every
    module: the class's replica, which copies the model's __dict__, then given a forward of its own (the
    copied one is bound to the model: each replica would run the original's weights on its device's inputs)."""

    def __init__(self, model, cls: type):
        self.__self__, self._cls = model, cls

    def __call__(self):
        replica = type(self.__self__)._replicate_for_data_parallel(self.__self__)
        if type(vars(replica).get("forward")) is _Forward:  # (a wrapper set after apply() is left as it is)
            replica.__dict__["forward"] = _Forward(replica, self._cls)
        replica.__dict__["_replicate_for_data_parallel"] = _Replicate(replica, self._cls)
        return replica

    def __reduce__(self):
        return _Replicate, (self.__self__, self._cls)


def _transformers():
    """The transformers package, or an ImportError that says how to install it."""
    try:
        import transformers  # noqa: PLC0415 (an optional extra)
    except ImportError as e:
        raise ImportError(
            f"fastsoftmax.integrations.transformers needs transformers>={MIN_TRANSFORMERS}: "
            'pip install "fastsoftmax[hf]"'
        ) from e
    from packaging.version import Version  # noqa: PLC0415 (a dependency of transformers)

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"fastsoftmax.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, "
            f"found {transformers.__version__}"
        )
    return transformers


def _family(model) -> type:
    """The supported class model is an instance of (its forward not overridden), else a TypeError."""
    names = ", ".join(SUPPORTED)
    hf = sys.modules.get("transformers")  # (a model of transformers means transformers is imported)
    if hf is None or not isinstance(model, _transformers().PreTrainedModel):
        raise TypeError(f"fastsoftmax: expected a transformers causal LM ({names}), got {type(model).__name__}")
    for cls in type(model).__mro__:
        if cls.__name__ in SUPPORTED and cls.__module__.startswith("transformers.models."):
            if type(model).forward is not cls.forward:
                raise TypeError(
                    f"fastsoftmax: {type(model).__name__} overrides {cls.__name__}.forward; the patch reproduces "
                    f"{cls.__name__}'s forward and would drop the override"
                )
            return cls
    raise TypeError(f"fastsoftmax: {type(model).__name__} is not a supported causal LM; supported: {names}")


# ---- the loss ----------------------------------------------------------------------------------------------


def causal_lm_loss(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor | None,
    *,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    memory: int | None = None,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss(head(hidden) softcapped, labels, ...) without the logits: hidden (B, S, d),
    labels (B, S) shifted inside (or shift_labels (B, S) as given); the mean over kept tokens, or the sum
    divided by num_items_in_batch. An fp32 loss. memory: fs.linear_cross_entropy's."""
    if shift_labels is None:
        # (labels padded with ignore_index then shifted, as ForCausalLMLoss: the last position predicts nothing,
        # and hidden needs no copy)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    x = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(hidden.device)
    if target.numel() != x.shape[0]:
        raise ValueError(
            f"fastsoftmax: labels of shape {tuple(shift_labels.shape)} do not match the hidden states' "
            f"{tuple(hidden.shape[:-1])} (logits_to_keep with labels?)"
        )
    reduction = "sum" if num_items_in_batch is not None else "mean"
    dt = x.dtype
    cast = dt in _LOW and not torch.is_autocast_enabled(x.device.type)
    with torch.autocast(x.device.type, dtype=dt) if cast else contextlib.nullcontext():
        loss = fs.linear_cross_entropy(
            x, head.weight, target, head.bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
            memory=memory,
        )  # fmt: skip
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss.float()  # (fp32 for a float64 model too: transformers' loss is of fp32 logits)


def _memory(memory: int | None, weight: torch.Tensor) -> int:
    """apply()'s memory=, or the step's rule from the head's weight as it is at the call."""
    return memory if memory is not None else lm_rules.step_memory(weight)


def _positional(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    """kwargs with the positional args named as the class's forward names them."""
    if len(args) > len(names):
        raise TypeError(f"forward() takes {len(names)} positional arguments but {len(args)} were given")
    for name, value in zip(names, args, strict=False):
        if name in kwargs:
            raise TypeError(f"forward() got multiple values for argument '{name}'")
        kwargs[name] = value
    return kwargs


def _keep_rule():
    """transformers' rule for ``logits_to_keep`` (slice_logits_to_keep: also (B, P) positions and (B, S)
    boolean masks), or None where this version has none. Looked up by apply(): an import inside the forward
    breaks torch.compile's graph (transformers' lazy module)."""
    from transformers import modeling_utils  # noqa: PLC0415 (an optional extra)

    return getattr(modeling_utils, "slice_logits_to_keep", None)


def _kept(hidden: torch.Tensor, keep, rule) -> torch.Tensor:
    """The hidden states whose logits ``logits_to_keep`` asks for: by ``rule`` (_keep_rule()) where there is
    one, else transformers' older rule (the last ``keep`` positions, or the positions a 1-D tensor names)."""
    if rule is not None:
        return rule(hidden, keep)
    return hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]


def _fused(self, kwargs: dict, cls: type):
    """cls's forward with the logits and loss replaced by causal_lm_loss (labels given)."""
    return_dict = self.config.return_dict  # (can_return_tuple's rule)
    passed = kwargs.pop("return_dict", None)
    return_dict = return_dict if passed is None else passed
    labels = kwargs.pop("labels")
    keep = kwargs.pop("logits_to_keep", 0)
    outputs = getattr(self, self.base_model_prefix)(**kwargs)
    hidden = _kept(outputs.last_hidden_state, keep, getattr(self, _STATE).keep_rule)
    loss = causal_lm_loss(
        hidden,
        self.lm_head,
        labels,
        softcap=getattr(self.config, "final_logit_softcapping", None) if cls.__name__ in SOFTCAPPED else None,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        ignore_index=kwargs.get("ignore_index", -100),
        shift_labels=kwargs.get("shift_labels"),
        memory=_memory(getattr(self, _STATE).memory, self.lm_head.weight),
    )
    out_cls = getattr(self, _STATE).output
    rest = {f: getattr(outputs, f, None) for f in out_cls.__dataclass_fields__ if f not in ("loss", "logits")}
    out = out_cls(loss=loss, logits=None, **rest)
    if return_dict:
        return out
    # (transformers' tuple drops None entries; logits keeps its place, as None, so that out[1] is still
    # the logits' position and the cache third)
    return (loss, None, *(v for k, v in rest.items() if v is not None))


@functools.cache
def _forward_for(cls: type):
    """The instance forward for a supported class: its signature and docstring (inspect.signature, which the
    Trainer reads to keep dataset columns, sees the class's), plus ``return_logits``."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    @functools.wraps(cls.forward)
    def forward(self, *args, return_logits: bool | None = None, **kwargs):
        if getattr(self, _STATE, None) is None:  # reverted while a later wrapper still holds this function
            return cls.forward(self, *args, **kwargs)
        if args:
            kwargs = _positional(names, args, kwargs)
        fused = kwargs.get("labels") is not None and (
            return_logits is False or (return_logits is None and self.training)
        )
        return _fused(self, kwargs, cls) if fused else cls.forward(self, **kwargs)

    return forward


def _output_class(cls: type):
    """The output class of cls.forward: its return annotation (in a union with tuple, in some versions)."""
    ann = inspect.signature(cls.forward, eval_str=True).return_annotation
    for out in (ann, *typing.get_args(ann)):
        if isinstance(out, type) and "logits" in getattr(out, "__dataclass_fields__", ()):
            return out
    raise TypeError(f"fastsoftmax: {cls.__name__}.forward has no output class with logits ({ann!r})")


# ---- attention -------------------------------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with fs.softmax, in transformers' attention-interface signature: query (B, H, Sq, D),
    key and value (B, H_kv, Sk, D), attention_mask a bool (True = keep) or additive float mask broadcastable
    to (B, H, Sq, Sk), or None (causal when Sq > 1 and the module is causal, as sdpa reads it). Returns the
    output (B, Sq, H, D) and the probabilities (B, H, Sq, Sk) in the query's dtype."""
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError(
            "fastsoftmax attention: attention sinks are not supported; use attn_implementation='eager'"
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            "fastsoftmax attention: position_bias is not supported; use attn_implementation='eager'"
        )
    from transformers.integrations.sdpa_attention import repeat_kv  # noqa: PLC0415 (an optional extra)

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # (eager's GQA heads)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len, kv_len = query.shape[-2], key.shape[-2]
    causal = False
    if attention_mask is None:
        causal = q_len > 1 and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if causal and kv_len > q_len:  # a static cache's prefill: the later slots are empty (as sdpa)
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    scores = torch.matmul(query, key.transpose(2, 3))
    if softcap is not None:  # (eager's order: scale, then cap; the mask after)
        scores = torch.tanh(scores * (scaling / softcap)) * softcap
        scaling = None
    probs = fs.softmax(scores, mask=attention_mask, scale=scaling, causal=causal, dtype=query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), probs


def register() -> None:
    """Registers NAME with transformers' AttentionInterface (attention_forward) and AttentionMaskInterface
    (sdpa's boolean masks), so that ``attn_implementation="fastsoftmax"`` can be given to from_pretrained,
    from_config or set_attn_implementation. apply(attention_softmax=True) calls it; calling it again is
    harmless."""
    hf = _transformers()
    from transformers.masking_utils import sdpa_mask  # noqa: PLC0415 (an optional extra)

    hf.AttentionInterface.register(NAME, attention_forward)
    hf.AttentionMaskInterface.register(NAME, sdpa_mask)


# ---- apply, revert ---------------------------------------------------------------------------------------


def apply(model, *, loss: bool = True, attention_softmax: bool = False, memory: int | None = None):
    """Patches ``model`` (this instance only) and returns it: ``loss=True``, the fused LM-head loss in
    training; ``attention_softmax=True``, fs.softmax in its eager attention. ``memory``: the loss's
    fs.linear_cross_entropy memory= (bytes of logits at a time; None: the head's gradient bytes / 4, which
    keeps a training step's peak at the backward's own: heuristics/lm_head.step_memory). See the module's
    docstring for what changes and what is refused. revert(model) undoes it.

    With ``attention_softmax=True`` and left padding, a pad position's query sees no key: its attention
    output is zeros, as sdpa's (transformers' default attention) is, where eager averages the values. The
    last pad position predicts the first real token, so a loss that keeps that label is sdpa's, not eager's;
    mask it (-100), or pad on the right, and the loss is both. (Eager's average comes from its finite mask,
    not from the data; matching it would cost a pass over the probabilities or a float mask per head.)"""
    if not isinstance(loss, bool) or not isinstance(attention_softmax, bool):
        raise TypeError("fastsoftmax.apply: loss and attention_softmax must be bools")
    if not (loss or attention_softmax):
        raise ValueError("fastsoftmax.apply: nothing to apply (loss=False and attention_softmax=False)")
    checks.memory_budget("fastsoftmax.apply", memory)
    if memory is not None and not loss:
        raise ValueError("fastsoftmax.apply: memory= is the loss's, and loss=False")
    cls = _family(model)
    if getattr(model, _STATE, None) is not None:
        raise ValueError("fastsoftmax.apply: already applied to this model; revert(model) first")
    if loss:
        _check_loss(model, cls)
    before = _check_attention(model) if attention_softmax else None
    state = _Patch(cls if loss else None, _output_class(cls) if loss else None, None, memory)
    if before is not None:
        register()
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation != NAME:
            raise ValueError(f"fastsoftmax.apply: {type(model).__name__} did not take attn_implementation={NAME!r}")
        state.attention_before = before
    if loss:
        model.forward = _Forward(model, cls)
        model._replicate_for_data_parallel = _Replicate(model, cls)
    setattr(model, _STATE, state)
    return model


def _check_loss(model, cls: type) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415 (an optional extra)

    if "forward" in vars(model):
        raise ValueError(
            "fastsoftmax.apply: model.forward is already replaced on this instance (another patch, or a wrapper "
            "such as accelerate's prepare()); apply fastsoftmax to the bare model first"
        )
    if model.loss_function is not ForCausalLMLoss:
        raise ValueError(
            f"fastsoftmax.apply: {cls.__name__}'s loss_function is {model.loss_function!r}, not transformers' "
            "ForCausalLMLoss, which the fused loss computes; apply(model, loss=False) keeps yours"
        )
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"fastsoftmax.apply: the LM head is a {type(head).__name__}, not a plain torch.nn.Linear "
            "(quantised or adapter-wrapped heads are not supported); apply(model, loss=False) leaves it"
        )


def _check_attention(model) -> str | None:
    """The model's attention implementation before (None: already NAME), or a ValueError."""
    impl = model.config._attn_implementation
    if impl == NAME:
        return None
    if impl != "eager":
        raise ValueError(
            f"fastsoftmax.apply: attention_softmax=True replaces eager attention's softmax, but this model runs "
            f"{impl!r} attention, which never builds the probabilities; load it with attn_implementation='eager' "
            f"(or {NAME!r}) to use it"
        )
    return impl


def revert(model):
    """Undoes apply(model) and returns the model: the instance's forward removed (the class's again), the
    attention implementation set back. A ValueError if the model is not patched."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("fastsoftmax.revert: this model is not patched (apply() was not called, or revert() was)")
    delattr(model, _STATE)
    if type(vars(model).get("_replicate_for_data_parallel")) is _Replicate:
        del model._replicate_for_data_parallel
    if state.cls is not None:
        current = vars(model).get("forward")
        if type(current) is _Forward and current._cls is state.cls:  # (also a shallow copy's: the original's)
            del model.forward
        else:  # (our function, now a pass-through, stays inside whatever wrapped it after apply())
            warnings.warn(
                "fastsoftmax.revert: model.forward was wrapped after apply() (e.g. by accelerate); the wrapper "
                "stays and calls the model's own forward",
                stacklevel=2,
            )
    if state.attention_before is not None:
        model.set_attn_implementation(state.attention_before)
    return model


@contextlib.contextmanager
def patched(model, *, loss: bool = True, attention_softmax: bool = False, memory: int | None = None):
    """``with patched(model): ...`` applies the patch (apply's options), yields the model, and reverts it on
    exit."""
    apply(model, loss=loss, attention_softmax=attention_softmax, memory=memory)
    try:
        yield model
    finally:
        revert(model)


__all__ = [
    "MIN_TRANSFORMERS",
    "NAME",
    "SOFTCAPPED",
    "SUPPORTED",
    "apply",
    "attention_forward",
    "causal_lm_loss",
    "patched",
]
__all__ += ["register", "revert"]
