"""The calibration table: measured bytes, turned into per-model formulas.

``calibration.json`` is written by ``videojob profile`` (runtime side: the real
diffusers/transformers modules at full size under FakeTensorMode with a
tracker of live tensor bytes). Here it is read without torch and fitted:
activations linear in tokens (denoise) or frames (decode), scaled by batch,
pixel area and dtype width.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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

    def weights(self, dtype: str) -> int:
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


def _fit_decode(model: dict[str, Any]) -> DecodeFit:
    untiled = sorted(_samples(model, "decode", tiling=False), key=lambda s: s["frames"])
    if not untiled:
        raise ValueError("no untiled decode samples")
    big = untiled[-1]
    if len(untiled) >= 2 and untiled[0]["frames"] != big["frames"]:
        small = untiled[0]
        per_frame = (big["activation_peak_bytes"] - small["activation_peak_bytes"]) / (big["frames"] - small["frames"])
    else:
        per_frame = big["activation_peak_bytes"] / big["frames"]
    base = big["activation_peak_bytes"] - per_frame * big["frames"]
    tiled = _samples(model, "decode", tiling=True)
    if tiled:
        t = tiled[0]
        output = 2 * t["frames"] * t["width"] * t["height"] * 3 * DTYPE_BYTES[t["dtype"]]
        tiled_fixed = max(t["activation_peak_bytes"] - output, 0.0)
    else:
        tiled_fixed = big["activation_peak_bytes"]
    return DecodeFit(base, per_frame, big["width"] * big["height"], tiled_fixed, big["dtype"])


def _model_cal(model: dict[str, Any]) -> ModelCal:
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
        )
        for name, c in model["components"].items()
    }
    encode: dict[str, float] = {}
    for s in _samples(model, "encode"):
        encode[s["dtype"]] = max(encode.get(s["dtype"], 0.0), float(s["activation_peak_bytes"]))
    image = [float(s["activation_peak_bytes"]) for s in _samples(model, "image_encode")]
    return ModelCal(components, encode, _fit_denoise(model), _fit_decode(model), max(image) if image else None)


@dataclass(frozen=True)
class Calibration:
    models: dict[str, ModelCal]
    environment: dict[str, Any]
    missing: dict[str, str]

    def model(self, model_id: str) -> ModelCal:
        try:
            return self.models[model_id]
        except KeyError:
            why = self.missing.get(model_id, "not profiled")
            raise KeyError(f"no memory calibration for {model_id}: {why}; run `videojob profile`") from None


def parse_calibration(data: dict[str, Any]) -> Calibration:
    if data.get("schema") != 1:
        raise ValueError(f"calibration schema {data.get('schema')!r} is not 1")
    return Calibration(
        models={mid: _model_cal(m) for mid, m in data["models"].items()},
        environment=data.get("environment", {}),
        missing=data.get("missing", {}),
    )


@lru_cache(maxsize=4)
def load_calibration(path: str | None = None) -> Calibration:
    """The checked-in table (or another file); parsed and fitted once."""
    return parse_calibration(json.loads(Path(path or CALIBRATION_FILE).read_text()))
