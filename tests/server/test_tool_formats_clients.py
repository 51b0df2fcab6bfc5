"""The newer tool-call formats through the official `openai` client: Granite 3.x and Phi-4-mini
(`<|tool_call|>` lists), GLM-4.5 (`<arg_key>`/`<arg_value>` pairs), Gemma 4 (`<|tool_call>call:f{k:v}`)
and pythonic (a Python list of calls, chosen with --tool-call-parser). Each is served over the tiny
Llama checkpoint with a tokenizer trained on the spot for a chat template that announces the format
(written for these tests after the shape of the family's own; the pythonic one is plain ChatML, as
Llama 3.2 announces nothing), its markers special or added tokens as in the family's tokenizer.

Replies are forced on the real engine (reasoning_kit.py): a reply with text and two calls comes back as
content and tool_calls, whole and streamed; the calls sent back as history are rendered in the format's
own syntax (by the template, or by the format into contents) and the tool results reach the prompt; and
a `required` choice on the random model makes a call that parses and validates whatever it samples.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve_bench.family_templates import ChatFormat

openai = pytest.importorskip("openai")

pytest.register_assert_rewrite("reasoning_kit")
from reasoning_kit import Replies  # noqa: E402
from tool_fixtures import SCHEMAS, TOOLS  # noqa: E402

pytest_plugins = ["reasoning_kit"]

ReplyMaker = Callable[[BackgroundServer], Replies]
ASK = [{"role": "user", "content": "What is the weather in Paris, and 1 + 2?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]

# Granite 3.x: tools in an available_tools turn, calls after <|tool_call|>, results in tool_response turns
GRANITE = ChatFormat(
    template=(
        "{%- if tools -%}<|start_of_role|>available_tools<|end_of_role|>{%- for t in tools -%}{{ (t | tojson) + '\\n' }}"
        "{%- endfor -%}{{ '<|end_of_text|>\\n' }}{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' and m.tool_calls -%}<|start_of_role|>assistant<|end_of_role|>{{ m.content or '' }}"
        "<|tool_call|>[{%- for c in m.tool_calls -%}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
        "{{ c.function.arguments | tojson }}}{{ ', ' if not loop.last }}{%- endfor -%}]"
        "{%- elif m.role == 'tool' -%}<|start_of_role|>tool_response<|end_of_role|>{{ m.content }}"
        "{%- else -%}<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}{%- endif -%}{{ '<|end_of_text|>\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|start_of_role|>assistant<|end_of_role|>{%- endif -%}"
    ),
    control=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
    stop=("<|end_of_text|>",), eos="<|end_of_text|>", pad="<|end_of_text|>", bos="<|end_of_text|>",
)
# Phi-4-mini: the tools in <|tool|> tags of the system turn, calls in <|tool_call|>...<|/tool_call|>
PHI4_MINI = ChatFormat(
    template=(
        "{%- if tools -%}<|system|>{{ messages[0].content if messages[0].role == 'system' else '' }}<|tool|>"
        "{{ tools | tojson }}<|/tool|><|end|>{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' and tools -%}"
        "{%- elif m.role == 'assistant' and m.tool_calls -%}<|assistant|>{{ m.content or '' }}<|tool_call|>["
        "{%- for c in m.tool_calls -%}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
        "{{ c.function.arguments | tojson }}}{{ ', ' if not loop.last }}{%- endfor -%}]<|/tool_call|><|end|>"
        "{%- else -%}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    ),
    control=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<|/tool|>",
             "<|tool_call|>", "<|/tool_call|>"),
    stop=("<|end|>", "<|endoftext|>"), eos="<|endoftext|>", pad="<|endoftext|>",
)
# GLM-4.5: [gMASK]<sop>, <|ROLE|> turns, calls as key/value tags (added tokens that are text), results in
# <|observation|> turns; a reply ends where the model writes the next turn's marker
GLM45 = ChatFormat(
    template=(
        "[gMASK]<sop>{%- if tools -%}<|system|>{{ '\\n# Tools' }}{%- for t in tools -%}{{ '\\n' + (t | tojson) }}"
        "{%- endfor -%}{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}{{ '<|assistant|>\\n' + (m.content or '') }}"
        "{%- for c in m.tool_calls or [] -%}{{ '\\n<tool_call>' + c.function.name + '\\n' }}"
        "{%- for k, v in c.function.arguments.items() -%}{{ '<arg_key>' + k + '</arg_key>\\n<arg_value>' }}"
        "{{ v if v is string else v | tojson }}{{ '</arg_value>\\n' }}{%- endfor -%}</tool_call>{%- endfor -%}"
        "{%- elif m.role == 'tool' -%}{{ '<|observation|>\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
        "{%- else -%}{{ '<|' + m.role + '|>\\n' + m.content }}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
    ),
    control=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    stop=("<|user|>", "<|observation|>", "<|endoftext|>"), eos="<|endoftext|>", pad="<|endoftext|>",
    plain=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
)
# Gemma 4: <|turn>ROLE turns, the tools declared in the system turn, calls and their results inside the
# model's turn (which a result leaves open for the model to go on), values in Gemma's notation
GEMMA4 = ChatFormat(
    template=(
        "{%- macro value(v) -%}"
        "{%- if v is string -%}{{ '<|\"|>' + v + '<|\"|>' }}"
        "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}{{ k + ':' }}{{ value(x) }}"
        "{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}"
        "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
        "{%- elif v is none -%}null"
        "{%- elif v is iterable -%}[{%- for x in v -%}{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}]"
        "{%- else -%}{{ v }}{%- endif -%}"
        "{%- endmacro -%}"
        "{{- bos_token -}}"
        "{%- if tools or messages[0].role == 'system' -%}{{ '<|turn>system\\n' }}"
        "{{ messages[0].content if messages[0].role == 'system' else '' }}"
        "{%- for t in tools or [] -%}<|tool>declaration:{{ t.function.name }}{{ value({'description': "
        "t.function.description or '', 'parameters': t.function.parameters}) }}<tool|>{%- endfor -%}"
        "{{ '<turn|>\\n' }}{%- endif -%}"
        "{%- set ns = namespace(open=false, name='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'user' -%}{{ '<turn|>\\n' if ns.open }}{%- set ns.open = false -%}"
        "{{ '<|turn>user\\n' + (m.content | trim) + '<turn|>\\n' }}"
        "{%- elif m.role == 'assistant' -%}{{ '' if ns.open else '<|turn>model\\n' }}{%- set ns.open = true -%}"
        "{{ (m.content or '') | trim }}"
        "{%- for c in m.tool_calls or [] -%}<|tool_call>call:{{ c.function.name }}{{ value(c.function.arguments) }}"
        "<tool_call|>{%- endfor -%}"
        "{%- if not m.tool_calls -%}{{ '<turn|>\\n' }}{%- set ns.open = false -%}{%- endif -%}"
        "{%- elif m.role == 'tool' -%}"
        "{%- for p in messages -%}{%- for c in p.tool_calls or [] -%}{%- if c.id == m.tool_call_id -%}"
        "{%- set ns.name = c.function.name -%}{%- endif -%}{%- endfor -%}{%- endfor -%}"
        "<|tool_response>response:{{ ns.name }}{{ value({'value': m.content}) }}<tool_response|>"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt and not ns.open -%}{{ '<|turn>model\\n' }}{%- endif -%}"
    ),
    control=("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
             "<|tool_response>", "<tool_response|>", '<|"|>'),
    stop=("<turn|>", "<|tool_response>", "<eos>"), eos="<eos>", pad="<pad>", bos="<bos>",
)
# plain ChatML, which says nothing of tools: they go into the system contents in the format's syntax
CHATML = ChatFormat(
    template=(
        "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
    ),
    control=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), stop=("<|im_end|>", "<|endoftext|>"), eos="<|im_end|>",
    pad="<|endoftext|>",
)


@dataclass(frozen=True)
class Case:
    chat: ChatFormat
    parser: str | None  # --tool-call-parser; None: told from the template
    reply: str  # text and both CALLS, as the family writes them
    history: str  # how the template (or the format) renders CALLS back into the prompt


CASES = {
    "granite": Case(GRANITE, None, 'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                   '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
                    '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add"'),
    "phi4_mini": Case(PHI4_MINI, None, 'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": '
                                       '"Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]<|/tool_call|>',
                      '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", '
                      '"arguments": {"a": 1, "b": 2}}]<|/tool_call|>'),
    "glm4": Case(GLM45, None, "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
                              "</arg_value>\n</tool_call>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1"
                              "</arg_value>\n<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
                 "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    "gemma4": Case(GEMMA4, None, 'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                                 "<|tool_call>call:add{a:1,b:2}<tool_call|>",
                   '<|turn>model\nLet me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                   '<|tool_call>call:add{a:1,b:2}<tool_call|><|tool_response>response:get_weather{value:<|"|>sunny, '
                   '21 C<|"|>}<tool_response|><|tool_response>response:add{value:<|"|>3<|"|>}<tool_response|>'),
    "pythonic": Case(CHATML, "pythonic", 'Let me check. <|python_tag|>[get_weather(city="Paris"), add(a=1, b=2)]',
                     '[get_weather(city="Paris"), add(a=1, b=2)]'),
}


def tool_model_dir(chat: ChatFormat, out: Path) -> Path:
    """The tiny Llama checkpoint with a tokenizer trained for `chat`, ending replies on its stop tokens."""
    from tiny_models import tiny_model_dir

    from radixserve_bench.chat_tokenizer import write_chat_tokenizer

    shutil.copytree(tiny_model_dir("llama"), out)
    tokenizer = write_chat_tokenizer(chat, out)
    ids = tokenizer.convert_tokens_to_ids
    tokens = dict(eos_token_id=[ids(t) for t in chat.stop], pad_token_id=ids(chat.pad),
                  bos_token_id=ids(chat.bos) if chat.bos else None)
    config = json.loads((out / "config.json").read_text())
    config.update(tokens, max_position_embeddings=4096)  # room for the tools' preamble on a 512-token vocabulary
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps(tokens))
    return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], BackgroundServer]]:
    made: dict[str, BackgroundServer] = {}

    def get(name: str) -> BackgroundServer:
        if name not in made:
            case = CASES[name]
            model = str(tool_model_dir(case.chat, tmp_path_factory.mktemp("tools") / name))
            srv = BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=512, forced_tokens=False)),
                                   ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5, tool_call_parser=case.parser))
            made[name] = srv.__enter__()
        return made[name]

    try:
        yield get
    finally:
        for srv in made.values():
            srv.__exit__(None, None, None)


def client(srv: BackgroundServer) -> Any:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def made(calls: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or ()]


@pytest.mark.parametrize("name", list(CASES))
def test_calls_come_back_whole_and_streamed(name: str, servers: Callable[[str], BackgroundServer],
                                            replies: ReplyMaker) -> None:
    srv = servers(name)
    forced, oai = replies(srv), client(srv)
    forced.force(CASES[name].reply)
    r = oai.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert made(choice.message.tool_calls) == CALLS
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or ())
    assert "get_weather" in forced.prompt_text()  # the tools reached the prompt

    forced.force(CASES[name].reply)
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, max_tokens=300,
                                             stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for frag in c.delta.tool_calls or ():
                call = calls.setdefault(frag.index, {"name": frag.function.name, "arguments": ""})
                call["arguments"] += frag.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == CALLS


@pytest.mark.parametrize("name", list(CASES))
def test_calls_sent_back_are_rendered_in_the_format(name: str, servers: Callable[[str], BackgroundServer],
                                                   replies: ReplyMaker) -> None:
    srv = servers(name)
    forced, oai = replies(srv), client(srv)
    forced.force(CASES[name].reply)
    first = oai.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, max_tokens=300)
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": text}
               for c, text in zip(message.tool_calls or (), ("sunny, 21 C", "3"), strict=True)]
    forced.force("It is sunny and 1 + 2 = 3.")
    follow = oai.chat.completions.create(model=srv.state.model_name, tools=TOOLS, max_tokens=60,
                                         messages=[*ASK, message.model_dump(exclude_none=True), *results])
    assert follow.choices[0].message.content == "It is sunny and 1 + 2 = 3." and follow.choices[0].finish_reason == "stop"
    prompt = forced.prompt_text()
    assert CASES[name].history in prompt, prompt
    assert "sunny, 21 C" in prompt


@pytest.mark.parametrize("name", list(CASES))
def test_required_makes_a_call_that_validates(name: str, servers: Callable[[str], BackgroundServer]) -> None:
    """The random model under the format's grammar (the markers as the tokenizer's tokens): whatever it
    samples is one call that parses and validates."""
    srv = servers(name)
    oai = client(srv)
    for seed in range(2):
        r = oai.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or ()
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
