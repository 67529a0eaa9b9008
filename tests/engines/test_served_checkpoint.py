"""serve_vllm.sh --model DIR --served-name NAME serves another checkpoint (here: a directory of
links to the tier's model, as a fine-tuned checkpoint saved next to it would be)."""

import engine as engines
import pytest
from engine import get_json, post_json


def test_serve_vllm_serves_another_model_dir_under_its_own_name(tmp_path):
    if engines.vllm_missing():
        pytest.fail(engines.vllm_missing(), pytrace=False)  # the tier never passes by running nothing
    checkpoint = tmp_path / "my-finetuned-checkpoint"
    checkpoint.mkdir()
    for source in engines.MODEL_DIR.iterdir():
        if source.name != ".installed":  # --model needs no install stamp
            (checkpoint / source.name).symlink_to(source)
    served = engines.start_vllm(model_dir=checkpoint, served_name="ckpt-step-100",
                                log=engines.ENGINES_DIR / "logs" / "vllm-checkpoint.log")
    try:
        assert [m["id"] for m in get_json(served.base_url + "/models")["data"]] == ["ckpt-step-100"]
        assert get_json(served.base_url + "/models")["data"][0]["root"] == str(checkpoint)
        answer = post_json(served.base_url + "/chat/completions",
                           {"model": "ckpt-step-100", "messages": [{"role": "user", "content": "Say hi."}],
                            "max_tokens": 4, "temperature": 0})
        assert answer["choices"][0]["message"]["content"]
    finally:
        engines.stop(served)
