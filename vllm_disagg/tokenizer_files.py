"""Where a model's tokenizer files are: the proxy tokenizes locally only with a ``tokenizer.json`` on disk."""

from __future__ import annotations

from pathlib import Path


def tokenizer_dir(name: str) -> str | None:
    """A directory holding ``tokenizer.json`` for ``name``: the directory itself, or, for a model id such as
    ``meta-llama/Meta-Llama-3-8B-Instruct``, its snapshot in the local Hugging Face cache (no download); None when
    neither has one."""
    if (Path(name) / "tokenizer.json").is_file():
        return name
    if Path(name).exists():
        return None
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(name, allow_patterns=["tokenizer*", "*.json"], local_files_only=True)
    except Exception:  # not installed, not a model id, not cached
        return None
    return snapshot if (Path(snapshot) / "tokenizer.json").is_file() else None


def local_tokenizer(name: str) -> str:
    """``tokenizer_dir(name)``; ValueError saying what to do when there is none."""
    found = tokenizer_dir(name)
    if found is None:
        raise ValueError(
            f"--tokenizer {name!r}: no tokenizer.json there nor in the local Hugging Face cache; give the model's "
            "directory, or leave --tokenizer out to tokenize on the instances"
        )
    return found
