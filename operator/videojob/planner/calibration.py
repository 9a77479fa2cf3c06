"""The calibration table: measured bytes, turned into per-model formulas.

``calibration.json`` is written by ``videojob profile`` (runtime side: the real
diffusers/transformers modules at full size under FakeTensorMode with a
tracker of live tensor bytes). Here it is read without torch and fitted:
activations linear in tokens (denoise) or frames (decode), scaled by batch,
pixel area and dtype width.

The table also carries every constant the memory and latency models use
(``constants``), each with where it came from: measured (by which command),
fitted (to which published figure: ``anchors.py``, fitted by ``fit.py`` when
the table is written) or assumed (and why). The planner reads the values from
here and nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SCHEMA = 2
CONSTANT_KINDS = ("measured", "fitted", "assumed", "counted")


@dataclass(frozen=True)
class Constants:
    """Every constant the memory and latency models use (values from the table's
    ``constants``; ``provenance`` says where each came from)."""

    # memory
    cuda_context_bytes: float
    fragmentation: float
    conv_workspace_bytes_per_pixel: float
    cache_residuals: dict[str, int]
    process_host_bytes: float
    group_offload_host_factor: float
    # latency
    a100_flops_per_s: float
    gpu_speed: dict[str, float]
    ulysses_overhead: float
    ring_overhead: float
    cfg_overhead: float
    pcie_bytes_per_s: float
    model_offload_bytes_per_s: float
    sequential_efficiency: float
    group_offload_overhead: float
    disk_bytes_per_s: float
    checkpoint_latent_copies: int
    decode_s_per_pixel_frame: float
    tiling_slowdown: float
    encode_seconds: float
    cache_evaluated_fraction: dict[str, float]
    provenance: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "provenance")

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> "Constants":
        missing = [n for n in cls.names() if n not in table]
        if missing:
            raise ValueError(f"calibration constants missing: {', '.join(missing)}; rerun `make calibrate`")
        for name in cls.names():
            entry = table[name]
            if entry.get("kind") not in CONSTANT_KINDS or not entry.get("provenance"):
                raise ValueError(f"calibration constant {name}: needs kind (one of {CONSTANT_KINDS}) "
                                 "and provenance")
        return cls(**{n: table[n]["value"] for n in cls.names()},
                   provenance={n: dict(table[n]) for n in cls.names()})

    def replace(self, **values: Any) -> "Constants":
        current = {n: getattr(self, n) for n in self.names()}
        return Constants(**{**current, **values}, provenance=self.provenance)


@dataclass(frozen=True)
class ComponentCal:
    """Weights of one module as built, per dtype (bytes)."""

    cls: str
    params: int
    num_blocks: int
    weight_bytes: dict[str, int]
    largest_leaf_bytes: dict[str, int]
    largest_block_bytes: dict[str, int]
    # Weights outside the repeated blocks (embeddings, heads): their own group.
    unmatched_bytes: dict[str, int] | None = None
    # Denoisers: the bytes with fp8 layerwise storage (float8 Linear/Conv
    # weights, the model's skip patterns kept), measured by the profile.
    fp8_weight_bytes: dict[str, int] | None = None

    def weights(self, dtype: str, fp8: bool = False) -> int:
        if fp8 and self.fp8_weight_bytes is not None:
            return self.fp8_weight_bytes[dtype]
        return self.weight_bytes[dtype]

    def leaf(self, dtype: str) -> int:
        return self.largest_leaf_bytes[dtype]

    def block(self, dtype: str) -> int:
        return self.largest_block_bytes[dtype]


@dataclass(frozen=True)
class DenoiseFit:
    """Transformer activation bytes per rank: (base + per_token x tokens) x batch factor."""

    base: float
    per_token: float
    batch1_ratio: float
    sample_dtype: str
    text_tokens: int

    def bytes(self, tokens: float, batch: int, dtype: str) -> float:
        scale = DTYPE_BYTES[dtype] / DTYPE_BYTES[self.sample_dtype]
        factor = self.batch1_ratio if batch == 1 else batch / 2
        return max(self.base + self.per_token * tokens, 0.0) * factor * scale


@dataclass(frozen=True)
class DecodeFit:
    """VAE decode activation bytes: untiled linear in frames and pixel area;
    tiled: a fixed tile working set plus the decoded video held twice."""

    base: float
    per_frame: float
    ref_pixels: int
    tiled_fixed: float
    sample_dtype: str

    def bytes(self, width: int, height: int, frames: int, tiling: bool, dtype: str) -> float:
        scale = DTYPE_BYTES[dtype] / DTYPE_BYTES[self.sample_dtype]
        if tiling:
            return (self.tiled_fixed + 2 * frames * width * height * 3 * DTYPE_BYTES[self.sample_dtype]) * scale
        area = width * height / self.ref_pixels
        return max(self.base + self.per_frame * frames, 0.0) * area * scale


@dataclass(frozen=True)
class ModelCal:
    components: dict[str, ComponentCal]
    encode_bytes: dict[str, float]
    denoise: DenoiseFit
    decode: DecodeFit
    # i2v and identity models encode the conditioning image (VAE or image
    # encoder) before denoising; None for text-only models.
    image_encode_bytes: float | None = None
    # The decode with the VAE's unread conv cache skipped
    # (strategies/vae_conv_cache.py); ``decode`` itself where that does not apply.
    decode_skip: DecodeFit | None = None
    constants: Constants | None = None

    def decode_fit(self, skip_unread_conv_cache: bool) -> DecodeFit:
        return self.decode_skip if skip_unread_conv_cache and self.decode_skip is not None else self.decode

    @property
    def denoiser(self) -> str:
        return "transformer" if "transformer" in self.components else "unet"

    @property
    def image_encoder(self) -> str:
        """The module that encodes the conditioning image."""
        return "image_encoder" if "image_encoder" in self.components else "vae"


def _samples(model: dict[str, Any], stage: str, **match: Any) -> list[dict[str, Any]]:
    return [
        s for s in model["samples"]
        if s["stage"] == stage and all(s.get(k) == v for k, v in match.items())
    ]


def _fit_denoise(model: dict[str, Any]) -> DenoiseFit:
    two = sorted(_samples(model, "denoise", batch=2), key=lambda s: s["latent_tokens"])
    if not two:
        raise ValueError("no batch-2 denoise samples")
    big = two[-1]
    if len(two) >= 2 and two[0]["latent_tokens"] != big["latent_tokens"]:
        small = two[0]
        per_token = (big["activation_peak_bytes"] - small["activation_peak_bytes"]) / (
            big["latent_tokens"] - small["latent_tokens"]
        )
    else:
        per_token = big["activation_peak_bytes"] / big["latent_tokens"]
    base = big["activation_peak_bytes"] - per_token * big["latent_tokens"]
    one = [s for s in _samples(model, "denoise", batch=1) if s["latent_tokens"] == big["latent_tokens"]]
    ratio = one[0]["activation_peak_bytes"] / big["activation_peak_bytes"] if one else 0.5
    return DenoiseFit(base, per_token, ratio, big["dtype"], big.get("text_tokens", 0))


def _decode_samples(model: dict[str, Any], skip: bool, **match: Any) -> list[dict[str, Any]]:
    return [s for s in _samples(model, "decode", **match) if bool(s.get("skip_unread_conv_cache")) == skip]


def _fit_decode(model: dict[str, Any], skip: bool = False) -> DecodeFit | None:
    untiled = sorted(_decode_samples(model, skip, tiling=False), key=lambda s: s["frames"])
    if not untiled:
        if skip:
            return None  # the strategy does not apply to this VAE
        raise ValueError("no untiled decode samples")
    big = untiled[-1]
    if len(untiled) >= 2 and untiled[0]["frames"] != big["frames"]:
        small = untiled[0]
        per_frame = (big["activation_peak_bytes"] - small["activation_peak_bytes"]) / (big["frames"] - small["frames"])
    else:
        per_frame = big["activation_peak_bytes"] / big["frames"]
    base = big["activation_peak_bytes"] - per_frame * big["frames"]
    tiled = _decode_samples(model, skip, tiling=True)
    if tiled:
        t = tiled[0]
        output = 2 * t["frames"] * t["width"] * t["height"] * 3 * DTYPE_BYTES[t["dtype"]]
        tiled_fixed = max(t["activation_peak_bytes"] - output, 0.0)
    else:
        tiled_fixed = big["activation_peak_bytes"]
    return DecodeFit(base, per_frame, big["width"] * big["height"], tiled_fixed, big["dtype"])


def _model_cal(model: dict[str, Any], constants: Constants | None = None) -> ModelCal:
    components = {
        name: ComponentCal(
            cls=c["class"],
            params=int(c["params"]),
            num_blocks=int(c.get("num_blocks", 0)),
            weight_bytes={k: int(v) for k, v in c["weight_bytes"].items()},
            largest_leaf_bytes={k: int(v) for k, v in c["largest_leaf_bytes"].items()},
            largest_block_bytes={k: int(v) for k, v in c["largest_block_bytes"].items()},
            unmatched_bytes=(
                {k: int(v) for k, v in c["group_offload_unmatched_bytes"].items()}
                if "group_offload_unmatched_bytes" in c else None
            ),
            fp8_weight_bytes=(
                {k: int(v) for k, v in c["fp8_weight_bytes"].items()} if "fp8_weight_bytes" in c else None
            ),
        )
        for name, c in model["components"].items()
    }
    encode: dict[str, float] = {}
    for s in _samples(model, "encode"):
        encode[s["dtype"]] = max(encode.get(s["dtype"], 0.0), float(s["activation_peak_bytes"]))
    image = [float(s["activation_peak_bytes"]) for s in _samples(model, "image_encode")]
    return ModelCal(components, encode, _fit_denoise(model), _fit_decode(model), max(image) if image else None,
                    decode_skip=_fit_decode(model, skip=True), constants=constants)


@dataclass(frozen=True)
class Calibration:
    models: dict[str, ModelCal]
    environment: dict[str, Any]
    missing: dict[str, str]
    constants: Constants | None = None

    def model(self, model_id: str) -> ModelCal:
        try:
            return self.models[model_id]
        except KeyError:
            why = self.missing.get(model_id, "not profiled")
            raise KeyError(f"no memory calibration for {model_id}: {why}; run `videojob profile`") from None


def parse_calibration(data: dict[str, Any]) -> Calibration:
    if data.get("schema") != SCHEMA:
        raise ValueError(f"calibration schema {data.get('schema')!r} is not {SCHEMA}; rerun `make calibrate`")
    constants = Constants.from_table(data.get("constants", {}))
    return Calibration(
        models={mid: _model_cal(m, constants) for mid, m in data["models"].items()},
        environment=data.get("environment", {}),
        missing=data.get("missing", {}),
        constants=constants,
    )


def parse_models(data: dict[str, Any], constants: Constants) -> dict[str, ModelCal]:
    """The models of a table (being written: no constants yet) with the given constants."""
    return {mid: _model_cal(m, constants) for mid, m in data.items()}


@lru_cache(maxsize=4)
def load_calibration(path: str | None = None) -> Calibration:
    """The checked-in table (or another file); parsed and fitted once."""
    return parse_calibration(json.loads(Path(path or CALIBRATION_FILE).read_text()))
