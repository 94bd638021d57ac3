"""Weight formats of linear layers: what config.json's quantization_config says (config.py) and
the FP8 format's parameters and loaders (fp8.py)."""
from nanovllm.layers.quantization.config import QuantConfig, resolve_quant_config
from nanovllm.layers.quantization.fp8 import Fp8Format


def linear_format(config: QuantConfig | None, names: list[str]) -> Fp8Format | None:
    """The weight format of the layer fused from these checkpoint modules (None: unquantized)."""
    if config is None or not config.quantizes(names):
        return None
    return Fp8Format(config)


__all__ = ["Fp8Format", "QuantConfig", "linear_format", "resolve_quant_config"]
