"""Chat templates: rendered and tokenized as transformers' apply_chat_template does, in jinja2's sandbox; the
Llama 3 / Llama 2 formats when a checkpoint has no template."""
import json

import pytest

import tokenizer
from errors import UserError
from helpers import (LLAMA2_CONFIG, auto_tokenizer, write_chatml_tokenizer, write_llama3_tokenizer,
                            write_sentencepiece_model)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12345 + 1?"}],
    [{"role": "system", "content": "You answer in French. Café, déjà vu."},
     {"role": "user", "content": "  Bonjour 🙂 \n"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "日本語で?\tplease"},
     {"role": "assistant", "content": "はい。", "tool_calls": None}, {"role": "user", "content": "thanks <s>"}],
]
ESCAPES = ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os.system('id') }}",
           "{% set x = messages.append({'role': 'user'}) %}", "{% set ns = namespace(_x=1) %}{{ ns._x }}"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"chatml": write_chatml_tokenizer(root / "chatml"), "llama3": write_llama3_tokenizer(root / "llama3")}


def hf_chat_ids(hf, conversation, add_generation_prompt=True):
    out = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_render_and_ids_equal_apply_chat_template(dirs, kind):
    hf, tok = auto_tokenizer(dirs[kind]), tokenizer.get_tokenizer(dirs[kind])
    assert tok.chat_template == hf.chat_template
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            text = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert tok.render_chat(conversation, add_generation_prompt=prompt) == text
            assert tok.chat_ids(conversation, add_generation_prompt=prompt) == hf_chat_ids(hf, conversation, prompt)
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}[kind]
    assert tok.processor.token_to_id(end) in tok.eos_ids


def test_template_helpers_match_transformers(dirs, tmp_path):
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{{ m | tojson }}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
                "{% generation %}{{ ns.n }} {{ dict(a=1) | tojson(indent=2) }}{% endgeneration %} "
                "{{ strftime_now('%Y') }} {{ bos_token }}{{ eos_token }}")
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((dirs["llama3"] / name).read_bytes())
    config = json.loads((dirs["llama3"] / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
    hf, tok = auto_tokenizer(tmp_path), tokenizer.get_tokenizer(tmp_path)
    conversation = CONVERSATIONS[2]
    assert tok.render_chat(conversation) == hf.apply_chat_template(conversation, tokenize=False,
                                                                   add_generation_prompt=True)


def test_template_sources(dirs, tmp_path):
    """chat_template.jinja beside the tokenizer wins over the config's; a list of templates gives "default"."""
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((dirs["chatml"] / name).read_bytes())
    config = json.loads((dirs["chatml"] / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ 'D' }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer.get_tokenizer(tmp_path).render_chat(CONVERSATIONS[0]) == "D"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}\n")
    tok = tokenizer.get_tokenizer(tmp_path)
    assert tok.render_chat(CONVERSATIONS[0]) == auto_tokenizer(tmp_path).apply_chat_template(
        CONVERSATIONS[0], tokenize=False) == "What is 12345 + 1?"  # jinja drops a final newline
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.jinja").mkdir()  # was passed over in silence for the built-in format
    with pytest.raises(UserError, match="chat_template.jinja is not a file"):
        tokenizer.get_tokenizer(tmp_path)


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_escape_is_refused(dirs, tmp_path, template):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((dirs["chatml"] / name).read_bytes())
    config = json.loads((dirs["chatml"] / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
    tok = tokenizer.get_tokenizer(tmp_path)
    with pytest.raises(UserError) as info:
        tok.render_chat(CONVERSATIONS[0])
    message = str(info.value)
    assert message.startswith(f"chat template in {tmp_path / 'tokenizer_config.json'} tried an unsafe operation: ")
    assert "\n" not in message
    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(UserError, match=f"chat template in {tmp_path / 'chat_template.jinja'} tried an unsafe"):
        tokenizer.get_tokenizer(tmp_path).chat_ids(CONVERSATIONS[0])


def test_broken_or_rejecting_template_is_a_user_error(dirs, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((dirs["chatml"] / name).read_bytes())
    config = json.loads((dirs["chatml"] / "tokenizer_config.json").read_text())
    source = tmp_path / "tokenizer_config.json"
    for template, error in [("{% for m in messages %}{{ m }}", "has a syntax error at line 1"),
                            ("{{ raise_exception('Only user and assistant roles are supported!') }}",
                             "rejected the conversation: Only user and assistant roles are supported!")]:
        source.write_text(json.dumps(dict(config, chat_template=template)))
        with pytest.raises(UserError, match=f"chat template in {source} {error}"):
            tokenizer.get_tokenizer(tmp_path).render_chat(CONVERSATIONS[0])


def test_llama3_format_without_template(dirs, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((dirs["llama3"] / name).read_bytes())
    config = json.loads((dirs["llama3"] / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, reference = tokenizer.get_tokenizer(tmp_path), tokenizer.get_tokenizer(dirs["llama3"])
    assert tok.chat_template is None
    for conversation in CONVERSATIONS:
        assert tok.render_chat(conversation) == reference.render_chat(conversation)  # Meta's template
        assert tok.chat_ids(conversation) == reference.chat_ids(conversation)
    assert tok.render_chat(CONVERSATIONS[0]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 12345 + 1?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama2_format_without_template(tmp_path):
    directory = write_sentencepiece_model(tmp_path / "llama2", config=LLAMA2_CONFIG)
    tok = tokenizer.get_tokenizer(directory)
    assert tok.chat_template is None
    text = tok.render_chat(CONVERSATIONS[2])
    assert text == ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST] Hello! How can I help? </s>"
                    "<s>[INST] 日本語で?\tplease [/INST] はい。 </s><s>[INST] thanks <s> [/INST]")
    ids = tok.chat_ids(CONVERSATIONS[2])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 4 and ids.count(2) == 2  # 3 turns + "<s>" in text
    assert ids == auto_tokenizer(directory).encode(text, add_special_tokens=False)
    with pytest.raises(UserError, match="built-in Llama 2 format .* rejected the conversation: Conversation roles"):
        tok.render_chat([{"role": "assistant", "content": "hi"}])
