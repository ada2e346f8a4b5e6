"""Where a config comes from: a YAML file, command-line flags and ``--set key=value`` overrides, layered
onto the defaults by ``build_config`` (later wins), each value coerced to its key's type (``coerce``)."""

from __future__ import annotations

import importlib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from cp_train.config.hf_init import apply_hf_model
from cp_train.config.schema import Config, ConfigError, field_type

# old key -> new key (still read, with a one-line note), for one release after the rename
DEPRECATED_KEYS = {"model.attention_layout": "parallel.cp_layout", "train.eval_interval": "train.valid_interval",
                   "train.eval_iters": "train.valid_iters", "model.attention_backend": "model.attention_kernel",
                   "optimizer.impl": "optimizer.implementation"}
SEEDS = ("data.seed", "model.seed", "eval.seed")  # follow train.seed unless set


def build_config(layers: list[tuple[str, dict[str, Any]]]) -> Config:
    """Defaults updated by each ``(source, {dotted key: value})`` layer in order (later wins). Deprecated keys
    set the new key and leave a one-line note in ``config.deprecations``."""
    config = Config()
    notes = []
    for source, values in layers:
        for key, value in values.items():
            if key in DEPRECATED_KEYS:
                notes.append(f"{source}: {key} is deprecated, use {DEPRECATED_KEYS[key]} (read as that)")
                if key == "optimizer.impl" and str(value) in ("auto", "torch"):  # torch's AdamW: the default
                    continue
                key = DEPRECATED_KEYS[key]
            try:
                kind = field_type(key)
            except ConfigError as error:
                raise ConfigError(f"{source}: {error}") from None
            section, name = key.split(".", 1)
            setattr(getattr(config, section), name, coerce(key, yaml_list(key, value, kind), kind))
    config.model.resolve()
    import_modules(config.train.imports)
    config.explicit_keys = frozenset(DEPRECATED_KEYS.get(key, key) for _, values in layers for key in values)
    for key in SEEDS:  # one seed for the run unless a part's is set
        if key not in config.explicit_keys:
            section, name = key.split(".")
            setattr(getattr(config, section), name, config.train.seed)
    config.deprecations = tuple(notes)
    if config.checkpoint.init_from_hf:
        apply_hf_model(config)  # the model's shape comes from the HF config.json
    return config


def yaml_list(key: str, value: Any, kind: Any) -> Any:
    """The value of a list key given as YAML text (``--set key=[a, b]``, a flag) as that list; any other value as it
    is (``coerce`` splits a comma list, ``a,b``)."""
    is_list = typing.get_origin(kind) is list or any(typing.get_origin(a) is list for a in typing.get_args(kind))
    if not is_list or not isinstance(value, str) or not value.strip().startswith("["):
        return value
    try:
        items = yaml.safe_load(value)
    except yaml.YAMLError:
        items = None
    if not isinstance(items, list):
        raise ConfigError(f"{key} expects a list, as a,b or [a, b]; got {value!r}")
    return items


def import_modules(names: list[str]) -> None:
    """Import ``train.imports`` (modules that register CP algorithms); ConfigError naming the one that fails."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ConfigError(f"train.imports: cannot import {name} ({error}): put its package on PYTHONPATH or "
                              f"install it") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} appears twice in one mapping: "
                                                        f"merge the two", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path, what: str = "--config") -> dict[str, Any]:
    """The mapping in YAML file ``path``; ConfigError naming the file as ``what`` (and the line of a syntax error).
    An empty file is an error: it would silently mean the defaults."""
    example = "(e.g. launch/configs/cpu-tiny.yaml)"
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory: pass a YAML file {example}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist: pass an existing YAML file {example}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {path} is not a YAML text file (byte {error.object[error.start]:#04x} at offset "
                          f"{error.start} is not UTF-8 text): pass a YAML file {example}") from None
    except OSError as error:
        raise ConfigError(f"{what} {path} cannot be read: {error}") from None
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(problem).split())}; fix the file") from None
    if tree is None:
        raise ConfigError(f"{what} {path} is empty: it holds no settings (it would mean every default); put the "
                          f"run's sections in it (model:, train:, ...) {example}")
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, train:, ...)")
    return tree


def load_config(path: str | Path | None = None, flags: dict[str, Any] | None = None,
                overrides: typing.Sequence[str] = (), what: str = "--config") -> Config:
    """The config of YAML ``path`` (named ``what`` in errors) < ``flags`` (dotted key -> value) < ``overrides``
    ("key=value")."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is not None:
        tree = read_yaml(Path(path), what)
        layers.append((str(path), flatten(tree, str(path))))
    layers.append(("command-line flags", dict(flags or {})))
    layers.append(("--set", dict(parse_override(o) for o in overrides)))
    return build_config(layers)


def flatten(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """``{"model": {"hidden_size": 8}}`` -> ``{"model.hidden_size": 8}``; ConfigError on bad nesting."""
    flat: dict[str, Any] = {}
    for section, values in (tree or {}).items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: {section!r} must be a mapping of keys (e.g. {section}: "
                              f"{{key: value}}), got {values!r}")
        for name, value in values.items():
            flat[f"{section}.{name}"] = value
    return flat


def parse_override(text: str) -> tuple[str, str]:
    """``"model.hidden_size=512"`` -> ``("model.hidden_size", "512")``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. model.hidden_size=512)")
    return key.strip(), value.strip()


_TRUE, _FALSE, _NULL = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}, {"null", "none", "~"}


def coerce(key: str, value: Any, kind: Any) -> Any:
    """``value`` as ``kind`` (int, float, bool, str, list[str] or an Optional of them); ConfigError naming
    ``key``. Floats must be finite; a list may be given as a comma-separated string."""
    args = typing.get_args(kind)
    is_null = value is None or (isinstance(value, str) and value.strip().lower() in _NULL)
    if typing.get_origin(kind) is list:
        if is_null:
            return []
        items = value if isinstance(value, list | tuple) else str(value).split(",")
        return [coerce(key, item, args[0]) for item in items if str(item).strip()]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if is_null:
            return None
        kind = next(a for a in args if a is not type(None))
        if typing.get_origin(kind) is list:  # an optional list (model.layer_types): null stays None
            return coerce(key, value, kind)
    if kind is str and isinstance(value, str) and value.strip():
        return value.strip()  # a required string is itself, "none" included (a mode's name)
    if is_null:
        raise ConfigError(f"{key} must not be null (expects {kind.__name__})")
    if typing.get_origin(kind) is dict:
        return _mapping(key, value)
    text = str(value).strip()
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value) if isinstance(value, int | float) else int(text)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            number = float(value) if isinstance(value, int | float) else float(text)
        elif kind is str:
            return text
        else:
            raise ConfigError(f"{key} has an unsupported type {kind}")
    except ConfigError:
        raise
    except (ValueError, OverflowError):
        raise ConfigError(f"{key} expects {kind.__name__}, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return number


def _mapping(key: str, value: Any) -> dict[str, Any]:
    """A mapping value: a dict (YAML) or its YAML/JSON text (flags, ``--set``)."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass
    if not isinstance(value, dict):
        raise ConfigError(f"{key} expects a mapping such as {{rope_type: llama3, factor: 8.0}}, got {value!r}")
    return dict(value)


def unused_settings(config: Config) -> tuple[str, ...]:
    """One note per key a layer set (``explicit_keys``) to a value this run cannot use, naming what the key needs:
    FSDP's options without FSDP, FP8's bf16 blocks without FP8, the CP check's tolerance without the check, the
    profile's steps and ranks without the profile, a checkpoint's options without ``checkpoint.save``, sequence
    parallelism at tp 1. The run goes on (the value does nothing); ``validate`` refuses what cannot run at all."""
    parallel, model, logging, ckpt = config.parallel, config.model, config.logging, config.checkpoint
    fsdp, fp8, profile, save = ("parallel.fsdp=true (--fsdp)", "model.fp8 tensorwise or rowwise",
                                "logging.profile=true (--profile)", "checkpoint.save (--save DIR)")
    needs = (("parallel.fsdp_reduce", fsdp, parallel.fsdp),
             ("parallel.fsdp_reshard_after_forward", fsdp, parallel.fsdp),
             ("model.fp8_bf16_layers_at_start", fp8, model.fp8 != "none"),
             ("model.fp8_bf16_layers_at_end", fp8, model.fp8 != "none"),
             ("model.fp8_fast_accum", fp8, model.fp8 != "none"),
             ("train.check_cp_tolerance", "train.check_cp_every > 0", config.train.check_cp_every > 0),
             ("logging.profile_step_start", profile, logging.profile),
             ("logging.profile_step_end", profile, logging.profile),
             ("logging.profile_ranks", profile, logging.profile),
             ("checkpoint.keep", save, bool(ckpt.save)),
             ("checkpoint.async_save", save, bool(ckpt.save) or not ckpt.async_save),  # false: nothing asked
             ("parallel.sequence_parallel", "parallel.tp > 1", parallel.tp > 1 or not parallel.sequence_parallel))
    return tuple(f"{key} is set but does nothing in this run: it needs {need}" for key, need, used in needs
                 if key in config.explicit_keys and not used)
