"""Conversion between our GPT-2 state dict and Hugging Face `GPT2LMHeadModel`'s, through `transformers`.

HF GPT-2 stores its projections as `Conv1D` with weight [in, out]; ours are `nn.Linear` [out, in],
so those four weights are transposed. Our embedding may be padded to a multiple of 128 rows; the
padded rows are zero when loading and dropped when exporting.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpt2.config.schema import MODEL_PRESETS, ConfigError, ModelConfig

# HF Conv1D weights that are [in, out] and need a transpose
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# what save_pretrained writes (one file, or shards and their index); transformers' names
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


def hf_to_ours(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a `GPT2LMHeadModel` state dict to our `GPT` state dict (fp32 copies)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in hf_sd.items():
        if key.startswith("lm_head.") or key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # tied with wte; causal-mask buffers of old checkpoints
        name = key.removeprefix("transformer.")
        if name.startswith("h."):
            name = "blocks." + name.removeprefix("h.")
        t = tensor.detach().float()
        if name.endswith(_CONV1D_SUFFIXES):
            t = t.t()
        out[name] = t.contiguous()
    wte = out["wte.weight"]
    if wte.shape[0] < cfg.padded_vocab_size:
        pad = wte.new_zeros(cfg.padded_vocab_size - wte.shape[0], wte.shape[1])
        out["wte.weight"] = torch.cat([wte, pad])
    out["lm_head.weight"] = out["wte.weight"]
    return out


def ours_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map our state dict to a `GPT2LMHeadModel` state dict (padded vocab rows dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        if name.startswith("lm_head."):
            continue
        t = tensor.detach().float().cpu()
        if name == "wte.weight":
            t = t[: cfg.vocab_size]
        if name.endswith(_CONV1D_SUFFIXES):
            t = t.t()
        key = "transformer." + ("h." + name.removeprefix("blocks.") if name.startswith("blocks.") else name)
        out[key] = t.contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_config_for(cfg: ModelConfig):
    """A `transformers.GPT2Config` describing the same architecture (dropout as configured)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, layer_norm_epsilon=cfg.layer_norm_eps,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        activation_function="gelu_new", tie_word_embeddings=True,
    )


def model_config_from_hf(name_or_path: str) -> dict[str, int]:
    """Architecture fields (n_layer, n_head, n_embd, n_positions, vocab_size) of an HF GPT-2."""
    from transformers import GPT2Config

    hf = GPT2Config.from_pretrained(name_or_path)
    return dict(n_layer=hf.n_layer, n_head=hf.n_head, n_embd=hf.n_embd,
                n_positions=hf.n_positions, vocab_size=hf.vocab_size)


def _check_hf_config(folder: Path) -> None:
    """A local --init-from folder must hold a GPT-2 config.json: transformers reads a folder without one as GPT-2
    small's defaults, and the architecture advice built on those would be wrong."""
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--init-from {folder} is not a Hugging Face GPT-2 folder: it has no config.json; pass a hub "
                          f"name ({', '.join(HUB_NAMES)}) or a folder written by save_pretrained or "
                          "`python -m gpt2.train.export CHECKPOINT FOLDER`")
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"--init-from {folder}: its config.json is not a Hugging Face config ({e})") from None
    if model_type != "gpt2":
        raise ConfigError(f"--init-from {folder} holds a {model_type!r} model, not GPT-2 (config.json's model_type); "
                          "pass GPT-2 weights")


def _check_hf_weights(folder: Path) -> None:
    if not any((folder / f).is_file() for f in HF_WEIGHT_FILES):
        raise ConfigError(f"--init-from {folder} has a GPT-2 config.json but no weights "
                          f"({' / '.join(HF_WEIGHT_FILES)}); pass the folder that save_pretrained or "
                          "`python -m gpt2.train.export` wrote")


def check_init_from(name_or_path: str, cfg: ModelConfig) -> None:
    """--init-from must name HF GPT-2 weights of this run's architecture; a ConfigError that names the flags
    otherwise. Reads only the config (cheap), so train.py calls it before data, a run folder or a model."""
    if name_or_path not in HUB_NAMES and not Path(name_or_path).is_dir():
        raise ConfigError(
            f"--init-from {name_or_path!r} is neither a hub name ({', '.join(HUB_NAMES)}) "
            "nor a local folder holding config.json and model weights")
    local = name_or_path not in HUB_NAMES
    if local:
        _check_hf_config(Path(name_or_path))
    try:
        theirs = model_config_from_hf(name_or_path)
    except OSError as err:
        raise ConfigError(f"--init-from {name_or_path}: cannot read its GPT-2 config ({err})") from err
    diffs = {k: v for k, v in theirs.items() if getattr(cfg, k) != v}
    if not diffs:
        if local:
            _check_hf_weights(Path(name_or_path))
        return
    preset = next((name for name, fields in MODEL_PRESETS.items()
                   if all(getattr(ModelConfig(**fields), k) == v for k, v in theirs.items())), None)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in diffs.items() if k in ("n_layer", "n_head", "n_embd"))
    fix = (f"pass --model {preset}" if preset else f"pass {flags}" if flags
           else "its n_positions / vocab_size differ from every preset's; this harness cannot build that model")
    raise ConfigError(f"--init-from {name_or_path} has " + ", ".join(f"{k} {v}" for k, v in diffs.items())
                      + ", this run's model " + ", ".join(f"{k} {getattr(cfg, k)}" for k in diffs) + f"; {fix}")


def load_hf_state_dict(name_or_path: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Load HF GPT-2 weights (hub name or local folder) and convert them to our layout."""
    from transformers import GPT2LMHeadModel

    check_init_from(name_or_path, cfg)
    hf = GPT2LMHeadModel.from_pretrained(name_or_path, torch_dtype=torch.float32)
    return hf_to_ours(hf.state_dict(), cfg)
