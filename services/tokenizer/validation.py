"""Request bodies -> `GenerationSpec`s, or `InvalidRequest` naming the offending field.

Every check that needs only the body and the model lives here, so a bad request never reaches
NATS and the HTTP layer turns `InvalidRequest` into an OpenAI-style 400.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from contracts.detokenizer import DetokenizeParams
from contracts.limits import MAX_CLIENT_RID_CHARS, MAX_TOKEN_IDS_LOGPROB, MAX_TOKENS
from contracts.scheduler import LogprobParams, SamplingParams
from services.tokenizer.api_types import GenerateBody, SamplingParamsBody, Unsupported
from services.tokenizer.invalid import InvalidRequest, require
from services.tokenizer.structured import generate_grammar
from services.tokenizer.text_model import TextModel


@dataclass(frozen=True)
class GenerationSpec:
    """One prompt's generation, validated: what the tokenizer sends and how it formats the answer."""

    rid: str  # unique on the wire (`wire_rids`): two clients' equal `rid`s never meet
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    logprobs: LogprobParams
    detokenize: DetokenizeParams
    stream: bool = False
    text_in_logprobs: bool = False
    flat_b64: bool = False
    request_id: str = ""  # the HTTP call's id (X-Request-Id): logs, NATS headers, response header
    response_id: str = ""  # what the response shows as this prompt's id (native: the client's rid)


@dataclass(frozen=True)
class LogprobRequest:
    """Logprob options as the three APIs spell them, before range checks."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    flat: bool = False
    flat_b64: bool = False


GENERATE_NAMES = {name: f"sampling_params.{name}" for name in SamplingParamsBody.__struct_fields__}
MAX_LOGIT_BIAS = 1024

# Documented limits (README, "Limits"): a request outside them is a 400 naming the field, never a
# 500 from deeper down, and one call cannot fan out into unbounded work.
MAX_BODY_BYTES = 10 * 1024 * 1024  # larger bodies get 413 before they are parsed
MAX_SEQUENCES_PER_CALL = 128  # prompts x n of one call
MAX_SEED = 2**63 - 1 - MAX_SEQUENCES_PER_CALL  # int64 on the wire, with room for the per-choice seed + j
MIN_SEED = -(2**63)
MAX_PROMPT_CHARS_PER_TOKEN = 32  # text longer than max_model_len x this is refused before tokenizing
MAX_N = 64  # choices per prompt
SEED_STRIDE = 0x9E3779B97F4A7C15  # choice j of a seeded call: a seed far from seed + 1, seed + 2, ...
MASK_63 = (1 << 63) - 1


def new_request_id() -> str:
    return uuid.uuid4().hex


def wire_rids(request_id: str, count: int) -> list[str]:
    """The scheduler/detokenizer keys of one call's `count` requests: the request id (so log
    lines keyed by rid still show it) plus a fresh nonce, unique even when a client reuses its
    X-Request-Id or `rid` (another client, another replica, a reconnect racing an abort)."""
    nonce = uuid.uuid4().hex[:12]
    return [f"{request_id}-{nonce}-{index}" for index in range(count)]


def check_prompt(ids: list[int], model: TextModel, param: str) -> tuple[int, ...]:
    require(len(ids) > 0, "the prompt is empty", param)
    bad = model.out_of_vocab(ids)
    require(bad is None, f"token id {bad} is outside the vocabulary [0, {model.vocab_size})", param)
    require(
        len(ids) < model.max_model_len,
        f"the prompt has {len(ids)} tokens; max_model_len is {model.max_model_len}",
        param,
    )
    return tuple(ids)


def check_sampling_bounds(body: SamplingParamsBody, names: Mapping[str, str]) -> None:
    """Integers `wire_checked` could not even encode (MessagePack stops at 64 bits), and the
    seed's headroom for the per-choice seeds. The other wire bounds are `wire_checked`'s."""
    require(body.max_new_tokens <= MAX_TOKENS, f"must be <= {MAX_TOKENS}", names["max_new_tokens"])
    require(body.top_k <= MAX_TOKENS, f"must be <= {MAX_TOKENS}", names["top_k"])
    seed_ok = body.seed is None or MIN_SEED <= body.seed <= MAX_SEED
    require(seed_ok, f"must be in [{MIN_SEED}, {MAX_SEED}]", names["seed"])


def check_generate_bounds(body: GenerateBody) -> None:
    """/generate fields outside `SamplingParamsBody` that have a size limit."""
    rids = [body.rid] if isinstance(body.rid, str) else body.rid or []
    require(all(0 < len(rid) <= MAX_CLIENT_RID_CHARS for rid in rids), f"1 to {MAX_CLIENT_RID_CHARS} characters", "rid")
    num_ids = len(body.token_ids_logprob or ())
    require(num_ids <= MAX_TOKEN_IDS_LOGPROB, f"at most {MAX_TOKEN_IDS_LOGPROB} ids", "token_ids_logprob")
    check_fan_out(_num_prompts(body), 1, "text" if body.text is not None else "input_ids")


def _num_prompts(body: GenerateBody) -> int:
    if isinstance(body.text, list):
        return len(body.text)
    ids = body.input_ids or []
    return len(ids) if ids and isinstance(ids[0], list) else 1


def check_fan_out(num_prompts: int, n: int, param: str) -> None:
    """One call becomes prompts x n scheduler requests: bounded, so a small body stays small work."""
    total = num_prompts * n
    require(total <= MAX_SEQUENCES_PER_CALL, f"{num_prompts} prompts x n={n} is {total} sequences; at most {MAX_SEQUENCES_PER_CALL}", param)


def check_n(n: int, num_prompts: int, param: str) -> None:
    require(1 <= n <= MAX_N, f"must be in [1, {MAX_N}]", param)
    check_fan_out(num_prompts, n, param)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of an `n`-choice call: choice 0 keeps `seed` (the same answer as
    `n=1`), the others get distinct seeds derived from it, so every choice is reproducible."""
    return seed if index == 0 else (seed + index * SEED_STRIDE) & MASK_63


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: the call's, with its seed from `choice_seed` (unseeded: the
    scheduler draws one per choice)."""
    if sampling.seed is None or index == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=choice_seed(sampling.seed, index))


def check_text_size(text: str, model: TextModel, param: str) -> None:
    """Refuse text that cannot fit max_model_len before spending seconds tokenizing it."""
    limit = model.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
    require(len(text) <= limit, f"the prompt has {len(text)} characters; at most {limit} (max_model_len x {MAX_PROMPT_CHARS_PER_TOKEN})", param)


def check_sampling(
    body: SamplingParamsBody, model: TextModel, names: Mapping[str, str] = GENERATE_NAMES
) -> tuple[SamplingParams, DetokenizeParams]:
    check_sampling_bounds(body, names)
    require(body.max_new_tokens >= 0, "must be >= 0", names["max_new_tokens"])  # before min_new_tokens' check
    require(0 < body.top_p <= 1, "must be in (0, 1]", names["top_p"])
    require(body.top_k == -1 or body.top_k >= 1, "must be -1 (disabled) or >= 1", names["top_k"])
    stop_ids = body.stop_token_ids or []
    bad = model.out_of_vocab(stop_ids)
    require(bad is None, f"token id {bad} is outside the vocabulary", names["stop_token_ids"])
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    check_penalties(body, names)
    sampling = SamplingParams(
        max_new_tokens=body.max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=body.ignore_eos,
        grammar=generate_grammar(body, names),
        **_processor_fields(body, check_logit_bias(body.logit_bias, model, names["logit_bias"])),
    )
    detokenize = DetokenizeParams(
        stop=tuple(stop),
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        no_stop_trim=body.no_stop_trim,
        min_tokens=body.min_new_tokens,
    )
    return wire_checked(sampling, names), wire_checked(detokenize, names)


def wire_checked(message: msgspec.Struct, names: Mapping[str, str]) -> msgspec.Struct:
    """`message` decoded as its receiver will decode it: every bound of the wire types
    (`contracts.limits`: temperature, min_p, stop strings, list sizes, ...) is a 400 naming the
    field, never a message the scheduler or detokenizer drops (the client would wait for a
    request that never runs). The hand-written checks add only what the wire allows but we
    refuse, or could not encode."""
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=type(message))
    except msgspec.ValidationError as exc:
        problem, _, where = str(exc).partition(" - at `$.")
        field = where.rstrip("`").split(".")[0].split("[")[0]
        raise InvalidRequest(problem, names.get(field, field or None)) from None
    return message


def check_penalties(body: SamplingParamsBody, names: Mapping[str, str]) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(body, name)
        require(math.isfinite(value) and -2 <= value <= 2, "must be in [-2, 2]", names[name])
    require(math.isfinite(body.repetition_penalty) and 0 < body.repetition_penalty <= 10, "must be in (0, 10]",
            names["repetition_penalty"])  # fmt: skip
    require(0 <= body.min_new_tokens <= body.max_new_tokens, "must be in [0, max tokens]", names["min_new_tokens"])


def _processor_fields(body: SamplingParamsBody, logit_bias: tuple[tuple[int, float], ...]) -> dict[str, Any]:
    """Only the logit-processor fields that differ from their defaults: a request without them
    encodes exactly as before they existed (omit_defaults compares floats by identity)."""
    values = {
        "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty, "min_new_tokens": body.min_new_tokens, "logit_bias": logit_bias,
    }  # fmt: skip
    defaults = SamplingParams()
    return {name: value for name, value in values.items() if value != getattr(defaults, name)}


def check_logit_bias(bias: Mapping[str, float] | None, model: TextModel, param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}` -> sorted (id, bias) pairs; ids in the vocabulary, bias in [-100, 100]."""
    if not bias:
        return ()
    require(len(bias) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} entries", param)
    pairs = []
    for key, value in bias.items():
        require(key.strip().lstrip("-").isdigit(), f"key {key!r} is not a token id", param)
        token = int(key)
        require(model.out_of_vocab([token]) is None, f"token id {token} is outside the vocabulary", param)
        require(math.isfinite(value) and -100 <= value <= 100, f"bias of {token} must be in [-100, 100]", param)
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def _neutral(name: str, value: Any) -> bool:
    """Whether an unsupported field's value asks for nothing beyond what we do anyway."""
    if value is None or value is False or value == [] or value == {}:
        return True
    neutral = {"modalities": (["text"],), "n": (1,)}
    return value in neutral.get(name, ())


def refuse_unsupported(body: msgspec.Struct, prefix: str = "", n: int = 1) -> None:
    """400 naming the first result-changing field this server does not implement (the fields
    `api_types` declares as `Unsupported`) that carries more than its neutral value."""
    for name in unsupported_fields(type(body)):
        value = getattr(body, name)
        if name == "best_of" and value in (1, n):
            continue
        require(_neutral(name, value), "is not supported by this server (it would change the result)", prefix + name)


@functools.cache
def unsupported_fields(kind: type[msgspec.Struct]) -> tuple[str, ...]:
    return tuple(f.name for f in msgspec.structs.fields(kind) if f.type == Unsupported)


def check_logprobs(
    request: LogprobRequest, num_prompt: int, model: TextModel, max_logprobs: int, names: Mapping[str, str]
) -> LogprobParams:
    start = request.logprob_start_len
    require(-1 <= start < num_prompt, f"must be -1 or in [0, {num_prompt}) (the prompt length)", names["logprob_start_len"])
    top = request.top_logprobs_num
    require(0 <= top <= max_logprobs, f"must be in [0, {max_logprobs}]", names["top_logprobs_num"])
    bad = model.out_of_vocab(list(request.token_ids_logprob))
    require(bad is None, f"token id {bad} is outside the vocabulary", names["token_ids_logprob"])
    require(
        request.flat or not request.flat_b64,
        "return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs",
        "return_flat_raw_top_logprobs_b64",
    )
    if not request.return_logprob:
        return LogprobParams()
    params = LogprobParams(
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=top,
        token_ids_logprob=request.token_ids_logprob,
        flat_prompt_top_logprobs=request.flat,
    )
    return wire_checked(params, names)


GENERATE_LOGPROB_NAMES = {
    "logprob_start_len": "logprob_start_len",
    "top_logprobs_num": "top_logprobs_num",
    "token_ids_logprob": "token_ids_logprob",
}


def generate_prompts(body: GenerateBody, model: TextModel) -> tuple[list[tuple[int, ...]], bool]:
    """The prompts of a /generate body as token ids, and whether the body is a batch."""
    require((body.text is None) != (body.input_ids is None), "give exactly one of text and input_ids", "text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        require(len(texts) > 0, "the batch is empty", "text")
        for text in texts:
            check_text_size(text, model, "text")
        return [check_prompt(model.encode(t), model, "text") for t in texts], not isinstance(body.text, str)
    ids = body.input_ids or []
    nested = any(isinstance(item, list) for item in ids)
    require(not nested or all(isinstance(item, list) for item in ids), "mixes ids and lists of ids", "input_ids")
    rows: list[list[int]] = ids if nested else [ids]  # type: ignore[assignment, list-item]
    require(len(rows) > 0, "the batch is empty", "input_ids")
    return [check_prompt(row, model, "input_ids") for row in rows], nested


def response_ids(rid: str | list[str] | None, count: int, is_batch: bool, request_id: str) -> list[str]:
    """`meta_info.id` per prompt: the client's `rid`s (a label, as SGLang returns them), else the
    request id (`-<index>` per prompt of a batch)."""
    if rid is None:
        return [f"{request_id}-{i}" for i in range(count)] if is_batch else [request_id]
    if isinstance(rid, str):
        require(not is_batch or count == 1, "a batch needs a list of rids", "rid")
        return [rid]
    require(len(rid) == count, f"has {len(rid)} entries for {count} prompts", "rid")
    require(len(set(rid)) == count, "rids must be unique", "rid")
    return list(rid)


@dataclass(frozen=True)
class GeneratePlan:
    """One /generate call: its specs (prompt-major, then the `n` choices of each prompt)."""

    specs: list[GenerationSpec]
    is_list: bool  # the answer is a list: a batch of prompts, or n > 1 (as SGLang answers)
    n: int


def validate_generate(body: GenerateBody, model: TextModel, max_logprobs: int, request_id: str) -> GeneratePlan:
    """All specs of one /generate call. With `sampling_params.n` > 1 each prompt has n choices
    (choice j's seed from `choice_seed`, its `meta_info.id` the prompt's id + `-j`)."""
    check_generate_bounds(body)
    sampling_body = body.sampling_params or SamplingParamsBody()
    refuse_unsupported(body)
    refuse_unsupported(sampling_body, "sampling_params.")
    prompts, is_batch = generate_prompts(body, model)
    n = sampling_body.n
    check_n(n, len(prompts), "sampling_params.n")
    require(not (is_batch and body.stream), "streaming a batch is not supported", "stream")
    sampling, detokenize = check_sampling(sampling_body, model)
    request = LogprobRequest(
        return_logprob=body.return_logprob,
        logprob_start_len=body.logprob_start_len,
        top_logprobs_num=body.top_logprobs_num,
        token_ids_logprob=tuple(body.token_ids_logprob or ()),
        flat=body.return_flat_raw_top_logprobs,
        flat_b64=body.return_flat_raw_top_logprobs_b64,
    )
    specs = []
    shown = response_ids(body.rid, len(prompts), is_batch, request_id)
    rids = iter(wire_rids(request_id, len(prompts) * n))
    for shown_id, prompt in zip(shown, prompts, strict=True):
        logprobs = check_logprobs(request, len(prompt), model, max_logprobs, GENERATE_LOGPROB_NAMES)
        for j in range(n):
            specs.append(
                GenerationSpec(
                    next(rids), prompt, choice_sampling(sampling, j), logprobs, detokenize, body.stream,
                    body.return_text_in_logprobs, request.flat_b64, request_id, shown_id if n == 1 else f"{shown_id}-{j}",
                )  # fmt: skip
            )
    return GeneratePlan(specs, is_batch or n > 1, n)
