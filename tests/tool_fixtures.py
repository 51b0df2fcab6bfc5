"""The tools the tool-calling tests offer: enums and bounded numbers, so a random model under a
constraint can never run a string or a number up to max_tokens."""

from __future__ import annotations

CITIES = ["Paris", "Rome", "Oslo"]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
