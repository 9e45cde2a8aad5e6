"""``--rope-theta``, ``--rope-scaling`` and ``--max-position-embeddings``: the model's RoPE changed for
continued pretraining at a longer context (a larger base, or a scaling such as YaRN, linear, llama3).

The flags change a copy of the transformers config before the model is built, from ``--model DIR``'s
config.json or ``--model-config``: ``--rope-scaling`` replaces ``config.rope_parameters`` (transformers'
name since 5.0 for what config.json called ``rope_scaling`` with ``rope_theta`` beside it; the model's
``rope_theta`` and ``partial_rotary_factor`` are kept unless the object gives its own), ``--rope-theta``
sets its ``rope_theta``, ``--max-position-embeddings`` the config's ``max_position_embeddings``. The
result goes through transformers' own ``standardize_rope_params`` and ``validate_rope``; a missing key,
an unknown key or a value transformers warns about (a factor below 1, a list of the wrong length) is a
ValueError naming the flag here, not a warning in the log of a run that trains something else.

A config with one RoPE per layer type (Gemma-3: ``{"sliding_attention": {...}, "full_attention":
{...}}``) takes ``--rope-scaling`` as an object keyed by layer types, each replacing that type's
parameters (the others kept); ``--rope-theta`` alone would not say which type's base it means, so it
is refused there. The changed config is what the run records (the start line of ``--json``, the
checkpoint's model fingerprint, checked on resume) and what ``--export-hf`` writes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import importlib
import logging
import math

FLAGS = ("--rope-theta", "--rope-scaling", "--max-position-embeddings")
_ORIGINAL = "original_max_position_embeddings"
_NEEDS_ORIGINAL = ("yarn", "llama3", "longrope")
_INHERITED = ("rope_theta", "partial_rotary_factor")  # kept from the model unless --rope-scaling sets them
# transformers' warnings that are no error here: its advice for a longrope without "factor" (it derives the
# factor from the lengths), and YaRN's factor against the lengths, which transformers logs once per process
# only and _check_yarn_length reports every time, with the flag to set
_ADVISORY = ("Please set the `factor` field", "The explicitly set RoPE scaling factor")


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--rope-theta", type=float, metavar="BASE", help="set the RoPE base (config rope_theta, e.g. 8000000 for "
      "continued pretraining at a longer context); recorded in the checkpoint and the --export-hf config")
    a("--rope-scaling", metavar="JSON", help="replace the model's RoPE parameters with this JSON object as "
      "transformers' config takes it, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
      "\"original_max_position_embeddings\": 8192}' (types: linear, dynamic, yarn, llama3, longrope; the "
      "model's rope_theta is kept unless given); models with one RoPE per layer type take an object keyed by "
      "layer type")
    a("--max-position-embeddings", type=int, metavar="N", help="set the config's max_position_embeddings (the "
      "new context length, e.g. original_max_position_embeddings x factor)")


def given(cfg) -> list[str]:
    """The RoPE flags ``cfg`` sets."""
    values = (cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    return [flag for flag, value in zip(FLAGS, values) if value is not None]


def parse_scaling(text: str | None) -> dict | None:
    """``--rope-scaling``'s JSON object (None when not given); ValueError naming the flag otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--rope-scaling: not valid JSON ({exc}); pass an object such as "
                         "'{\"rope_type\": \"linear\", \"factor\": 2.0}'") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"--rope-scaling: expected a non-empty JSON object of RoPE parameters, got {text!r}")
    return value


def apply(config, cfg):
    """A copy of the transformers ``config`` with ``cfg``'s RoPE flags applied, standardised and validated
    by transformers (``config`` itself when no flag is given). ValueError naming the flag when a value is
    unusable, before any model is built."""
    flags = given(cfg)
    if not flags:
        return config
    scaling = parse_scaling(cfg.rope_scaling)
    if cfg.rope_theta is not None and not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise ValueError(f"--rope-theta: expected a positive finite base (e.g. 500000), got {cfg.rope_theta}")
    if cfg.max_position_embeddings is not None and cfg.max_position_embeddings < 1:
        raise ValueError(f"--max-position-embeddings: expected a positive length, got {cfg.max_position_embeddings}")
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise ValueError(f"{flags[0]}: the model's config ({type(text).__name__}) has no RoPE parameters "
                         "(rope_parameters) to change")
    # per layer type when transformers says so (a key is one of the config's layer types): every such entry
    nested = [k for k, v in params.items() if isinstance(v, dict)] if text.nested_rope_parameter_keys(params) else []
    if cfg.max_position_embeddings is not None:
        text.max_position_embeddings = cfg.max_position_embeddings
    if nested:
        text.rope_parameters = _nested(params, nested, scaling, cfg.rope_theta)
    else:
        text.rope_parameters = _flat(params, scaling, cfg.rope_theta, text)
    _validate(text, flags)
    return config


def _nested(params: dict, types: list[str], scaling: dict | None, theta: float | None) -> dict:
    example = json.dumps({types[-1]: {"rope_type": "default", "rope_theta": 1e6}})
    if theta is not None:
        raise ValueError(f"--rope-theta: the model has one RoPE per layer type ({', '.join(types)}), each with its "
                         f"own base; give the base of the types to change in --rope-scaling, e.g. '{example}'")
    if scaling is None:
        return params
    unknown = sorted(set(scaling) - set(types))
    if unknown or not all(isinstance(v, dict) for v in scaling.values()):
        raise ValueError(f"--rope-scaling: the model has one RoPE per layer type ({', '.join(types)}); pass an "
                         f"object keyed by layer type with one parameter object each, e.g. '{example}' (got keys "
                         f"{', '.join(map(str, scaling))})")
    out = copy.deepcopy(params)
    for layer_type, values in scaling.items():
        out[layer_type] = _replaced(params[layer_type] or {}, values, f" ({layer_type})")
    return out


def _flat(params: dict, scaling: dict | None, theta: float | None, text) -> dict:
    out = dict(params) if scaling is None else _replaced(params, scaling, "")
    if theta is not None:
        out["rope_theta"] = float(theta)
    if _ORIGINAL in out and hasattr(text, _ORIGINAL):  # Phi-3's copy outside rope_parameters wins in transformers
        text.original_max_position_embeddings = out[_ORIGINAL]
    return out


def _replaced(old: dict, new: dict, where: str) -> dict:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kinds = ["default", *ROPE_INIT_FUNCTIONS]
    kind = new.get("rope_type", new.get("type"))
    if kind not in kinds:
        raise ValueError(f"--rope-scaling{where}: 'rope_type' must be one of {', '.join(kinds)}; got {kind!r}")
    if kind in _NEEDS_ORIGINAL and _ORIGINAL not in new:
        raise ValueError(f"--rope-scaling{where}: rope_type {kind!r} needs {_ORIGINAL!r}, the context length the "
                         "model was pretrained at (e.g. its config's max_position_embeddings before the change)")
    out = copy.deepcopy(new)
    for key in _INHERITED:
        if key in old and key not in out:
            out[key] = old[key]
    _check_numbers(old, out, where)
    return out


def _check_numbers(old: dict, params: dict, where: str) -> None:
    """What transformers' validation lets through: a non-finite number (an infinite factor rotates every
    position alike, and trains), a base that is no positive number (a TypeError or a NaN buffer when the
    model is built), another partial_rotary_factor than the model's (the share of each head the attention
    rotates: architecture, not length; Llama's attention rotates whole heads and fails on any other)."""
    for key, value in params.items():
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
            raise ValueError(f"--rope-scaling{where}: {key!r} must be finite, got {value}")
    theta = params.get("rope_theta")
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0):
        raise ValueError(f"--rope-scaling{where}: 'rope_theta' must be a positive number (the base, e.g. 10000.0), "
                         f"got {theta!r}")
    if params.get("partial_rotary_factor", 1.0) != old.get("partial_rotary_factor", 1.0):
        raise ValueError(f"--rope-scaling{where}: 'partial_rotary_factor' is the model's architecture (the share of "
                         f"each head rotated: {old.get('partial_rotary_factor', 1.0)} here), not a RoPE scaling; "
                         "leave it out")


def _validate(text, flags: list[str]) -> None:
    """transformers' standardisation and validation of ``text.rope_parameters``; its exceptions and
    warnings as a ValueError naming the flags."""
    name = "/".join(flags)
    with _warnings_of("transformers.modeling_rope_utils") as warned:
        try:
            text.standardize_rope_params()
            text.validate_rope()
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{name}: transformers refuses the RoPE parameters {text.rope_parameters}: "
                             f"{exc}") from None
    problems = [m for m in warned if not any(a in m for a in _ADVISORY)]
    if problems:
        raise ValueError(f"{name}: transformers' RoPE validation of {text.rope_parameters}: {'; '.join(problems)}")
    _check_yarn_length(text, name)


def _check_yarn_length(text, name: str) -> None:
    """YaRN's factor against max_position_embeddings / original_max_position_embeddings: transformers warns
    only once per process when they disagree (and uses the factor); here it is an error every time."""
    nested = text.nested_rope_parameter_keys(text.rope_parameters)
    for params in [text.rope_parameters[k] for k in nested] or [text.rope_parameters]:
        if not params or params.get("rope_type") != "yarn":
            continue
        implicit = text.max_position_embeddings / params[_ORIGINAL]
        if implicit not in (1, params["factor"]):
            raise ValueError(f"{name}: YaRN's factor {params['factor']} disagrees with max_position_embeddings "
                             f"{text.max_position_embeddings} / original_max_position_embeddings {params[_ORIGINAL]} "
                             f"= {implicit:g}; set --max-position-embeddings to "
                             f"{round(params[_ORIGINAL] * params['factor'])} (original_max_position_embeddings x "
                             f"factor) or to {params[_ORIGINAL]} (the original length)")


def summary(config) -> dict:
    """The RoPE a run trains with (its ``--json`` start line, its checkpoint's meta.json)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"rope_parameters": copy.deepcopy(getattr(text, "rope_parameters", None)),
            "max_position_embeddings": getattr(text, "max_position_embeddings", None)}


@contextlib.contextmanager
def _warnings_of(name: str):
    """The messages logged at WARNING or above inside the block by the logger of module ``name`` (the
    object the module logs to, which a reset of the logging registry may have detached from
    ``logging.getLogger(name)``), whatever the process's logging state: its level, ``disabled`` flag
    and filters, and a global ``logging.disable``, are lifted for the block and restored after (the
    warnings are what the validation reports: the process's logging must not decide what is refused)."""
    logger = getattr(importlib.import_module(name), "logger", None)
    if not isinstance(logger, logging.Logger):
        logger = logging.getLogger(name)
    messages = []

    class _Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = _Collect(logging.WARNING)
    saved = (logger.level, logger.disabled, list(logger.filters), logging.root.manager.disable)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.disabled, logger.filters = False, []
    logging.disable(logging.NOTSET)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.disabled, logger.filters = saved[1], saved[2]
        logging.disable(saved[3])


__all__ = ["FLAGS", "add_arguments", "apply", "given", "parse_scaling", "summary"]
