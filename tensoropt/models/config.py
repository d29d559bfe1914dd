"""Zoo configurations: one frozen dataclass per model family, presets, knob checks.

A preset (``tiny``, ``small``, ``paper``) gives every field; knobs override single
fields. All validation happens here, before any graph is built, so a bad request
fails with one clear :class:`ZooError` that lists what would have been valid.
The preset numbers are documented in docs/design/zoo.md.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from tensoropt.errors import TensorOptError


class ZooError(TensorOptError):
    """An unknown model, preset or knob, a bad knob value, or an unwritable output."""


class Preset(enum.Enum):
    TINY = "tiny"
    SMALL = "small"
    PAPER = "paper"


class Task(enum.Enum):
    """What a model predicts, which fixes its label convention."""

    LM = "lm"
    """labels int64 [B, S]: the next token at every position."""
    CLASSIFICATION = "classification"
    """labels int64 [B]: one class per example."""


@dataclass(frozen=True, slots=True)
class MlpConfig:
    """x float [batch, features] -> `layers` x (Linear, Relu) -> logits [batch, classes]."""

    batch: int
    features: int
    hidden: int
    layers: int
    classes: int
    seed: int = 0

    def check(self, name: str) -> None:
        del name


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """GPT (causal, pre-LN) and BERT (bidirectional, post-LN); the MLP is 4*hidden wide."""

    layers: int
    hidden: int
    heads: int
    batch: int
    seq: int
    vocab: int
    seed: int = 0

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self, name: str) -> None:
        if self.hidden % self.heads:
            raise ZooError(
                f"model {name}: --hidden {self.hidden} is not divisible by --heads {self.heads}; "
                "choose --hidden as a multiple of --heads"
            )


@dataclass(frozen=True, slots=True)
class CnnConfig:
    """image float [batch, 3, image_size, image_size] -> logits [batch, classes].

    `hidden` is the base channel width: 64 in the published networks, and every layer's
    width scales with hidden/64. `widen` is the WRN inner-width factor (wide_resnet only).
    """

    batch: int
    image_size: int
    classes: int
    hidden: int
    widen: int = 1
    seed: int = 0

    def scaled(self, channels: int) -> int:
        """A published channel count, scaled to this config's base width."""
        return max(1, round(channels * self.hidden / 64))

    def check(self, name: str) -> None:
        minimum = MIN_IMAGE_SIZE.get(name, 1)
        if self.image_size < minimum:
            raise ZooError(
                f"model {name}: --image-size {self.image_size} is too small, the feature maps "
                f"would vanish; use --image-size {minimum} or more"
            )


@dataclass(frozen=True, slots=True)
class RnnConfig:
    """LSTM language model; the embedding width equals `hidden`."""

    layers: int
    hidden: int
    batch: int
    seq: int
    vocab: int
    seed: int = 0

    def check(self, name: str) -> None:
        del name


ModelConfig = MlpConfig | TransformerConfig | CnnConfig | RnnConfig

MAX_KNOB = 2**31 - 1
"""The largest value of any knob: far beyond any model a knob shapes, and small enough
that the int64 shape constants the builder writes (and products of a few) hold it."""

MIN_IMAGE_SIZE = {"vgg16": 32, "resnet50": 32, "wide_resnet": 32, "inception_v3": 75}

_T = TransformerConfig
_C = CnnConfig
_R = RnnConfig
_TINY, _SMALL, _PAPER = Preset.TINY, Preset.SMALL, Preset.PAPER

PRESETS: dict[str, dict[Preset, ModelConfig]] = {
    "mlp": {
        _TINY: MlpConfig(batch=8, features=32, hidden=64, layers=2, classes=16),
        _SMALL: MlpConfig(batch=64, features=256, hidden=1024, layers=4, classes=64),
        _PAPER: MlpConfig(batch=64, features=4096, hidden=4096, layers=8, classes=1000),
    },
    "gpt": {
        _TINY: _T(layers=2, hidden=32, heads=4, batch=8, seq=8, vocab=64),
        _SMALL: _T(layers=4, hidden=256, heads=8, batch=8, seq=64, vocab=512),
        _PAPER: _T(layers=36, hidden=1280, heads=20, batch=8, seq=1024, vocab=50304),
    },
    "bert": {
        _TINY: _T(layers=2, hidden=32, heads=4, batch=8, seq=8, vocab=64),
        _SMALL: _T(layers=4, hidden=256, heads=8, batch=8, seq=64, vocab=512),
        _PAPER: _T(layers=24, hidden=1024, heads=16, batch=8, seq=512, vocab=30528),
    },
    "vgg16": {
        _TINY: _C(batch=8, image_size=32, classes=16, hidden=8),
        _SMALL: _C(batch=16, image_size=64, classes=64, hidden=16),
        _PAPER: _C(batch=64, image_size=224, classes=1000, hidden=64),
    },
    "resnet50": {
        _TINY: _C(batch=8, image_size=32, classes=16, hidden=8),
        _SMALL: _C(batch=16, image_size=64, classes=64, hidden=16),
        _PAPER: _C(batch=64, image_size=224, classes=1000, hidden=64),
    },
    "wide_resnet": {
        _TINY: _C(batch=8, image_size=32, classes=16, hidden=8, widen=2),
        _SMALL: _C(batch=16, image_size=64, classes=64, hidden=16, widen=2),
        _PAPER: _C(batch=64, image_size=224, classes=1000, hidden=64, widen=2),
    },
    "inception_v3": {
        _TINY: _C(batch=8, image_size=75, classes=16, hidden=8),
        _SMALL: _C(batch=16, image_size=139, classes=64, hidden=16),
        _PAPER: _C(batch=64, image_size=299, classes=1000, hidden=64),
    },
    "rnnlm": {
        _TINY: _R(layers=2, hidden=32, batch=8, seq=8, vocab=64),
        _SMALL: _R(layers=2, hidden=256, batch=16, seq=35, vocab=1024),
        _PAPER: _R(layers=2, hidden=2048, batch=64, seq=35, vocab=10000),
    },
}

MODEL_NAMES: tuple[str, ...] = tuple(PRESETS)
PRESET_NAMES: tuple[str, ...] = tuple(p.value for p in Preset)
CLI_KNOBS: tuple[str, ...] = (
    "layers",
    "hidden",
    "heads",
    "batch",
    "seq",
    "vocab",
    "image_size",
    "classes",
    "widen",
    "seed",
)
"""Knobs the command line offers; the Python API also takes every other config field."""

TASKS: dict[str, Task] = {
    name: Task.LM if name in ("gpt", "bert", "rnnlm") else Task.CLASSIFICATION
    for name in MODEL_NAMES
}


def check_name(name: str) -> None:
    if name not in PRESETS:
        raise ZooError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


def parse_preset(preset: str | Preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return Preset(preset)
    except ValueError:
        raise ZooError(
            f"unknown preset {preset!r}; choose one of: {', '.join(PRESET_NAMES)}"
        ) from None


def knobs_for(name: str) -> tuple[str, ...]:
    """The knobs that model `name` accepts (its config fields; widen only for wide_resnet)."""
    check_name(name)
    cls = type(PRESETS[name][Preset.TINY])
    fields = tuple(f.name for f in dataclasses.fields(cls))
    if name != "wide_resnet":
        fields = tuple(f for f in fields if f != "widen")
    return fields


def preset_config(name: str, preset: str | Preset = "tiny") -> ModelConfig:
    """The configuration of model `name` at `preset`, before any knob."""
    check_name(name)
    return PRESETS[name][parse_preset(preset)]


def configure(name: str, preset: str | Preset = "tiny", **knobs: int | None) -> ModelConfig:
    """Preset values overridden by the knobs that are not None, validated."""
    base = preset_config(name, preset)
    allowed = knobs_for(name)
    given = {k: v for k, v in knobs.items() if v is not None}
    for key, value in given.items():
        _check_knob(name, key, value, allowed)
    config = dataclasses.replace(base, **given)
    config.check(name)
    return config


def _check_knob(name: str, key: str, value: object, allowed: tuple[str, ...]) -> None:
    flag = "--" + key.replace("_", "-")
    if key not in allowed:
        raise ZooError(
            f"knob {flag} does not apply to model {name}; its knobs are: "
            + ", ".join("--" + k.replace("_", "-") for k in allowed)
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ZooError(f"model {name}: {flag} must be an integer, got {value!r}")
    minimum = 0 if key == "seed" else 1
    if value < minimum:
        raise ZooError(f"model {name}: {flag} must be >= {minimum}, got {value}")
    if value > MAX_KNOB:
        raise ZooError(
            f"model {name}: {flag} {value} is too large; give at most {MAX_KNOB} (2**31 - 1)"
        )
