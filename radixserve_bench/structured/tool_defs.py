"""The tool-call part of the workload: tools in OpenAI's function format (name, description, parameters,
strict) and, for each, a user question that calls for it. A request offers every tool, with
tool_choice "required" (the model picks) or named (this tool); its reply must parse into calls
whose arguments validate against the called tool's parameters.

Invariant: names are unique and every `parameters` is a valid Draft 2020-12 object schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve_bench.structured.schemas import Schema, arr, b, e, i, n, obj, s

_DATE = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"


@dataclass(frozen=True)
class BenchTool:
    name: str
    description: str
    parameters: Schema
    question: str  # a user message this tool answers

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI `tools` entry."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters, "strict": True}}


TOOLS: list[BenchTool] = [
    BenchTool("get_weather", "Current weather for a city.",
              obj({"city": s(40), "unit": e("celsius", "fahrenheit")}, ("city",)),
              "What's the weather like in Paris right now, in celsius?"),
    BenchTool("get_stock_price", "Latest price of a stock by its ticker symbol.",
              obj({"symbol": s(5, pattern=r"^[A-Z]{1,5}$")}), "How much is one Apple share (AAPL) worth today?"),
    BenchTool("book_flight", "Book a flight between two airports.",
              obj({"origin": s(3, pattern=r"^[A-Z]{3}$"), "destination": s(3, pattern=r"^[A-Z]{3}$"),
                   "date": s(10, pattern=_DATE), "passengers": i(1, 9), "cabin": e("economy", "business", "first")},
                  ("origin", "destination", "date")),
              "Book me an economy flight from JFK to LHR on 2026-03-14 for two people."),
    BenchTool("send_email", "Send an email.",
              obj({"to": s(40, pattern=r"^[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.(com|org|net)$"), "subject": s(60), "body": s(200)}),
              "Email bob@example.com that the meeting moved to 3pm."),
    BenchTool("create_calendar_event", "Create an event in the user's calendar.",
              obj({"title": s(40), "date": s(10, pattern=_DATE), "start_time": s(5, pattern=r"^[0-2][0-9]:[0-5][0-9]$"),
                   "duration_minutes": i(5, 600)}, ("title", "date", "start_time")),
              "Put a dentist appointment in my calendar on 2026-05-02 at 09:30 for 45 minutes."),
    BenchTool("search_products", "Search the shop's catalog.",
              obj({"query": s(40), "category": e("books", "electronics", "garden", "toys"), "max_price": n(0, 100000),
                   "in_stock": b()}, ("query",)),
              "Find me a cheap electric kettle under 30 dollars that is in stock."),
    BenchTool("convert_currency", "Convert an amount between currencies.",
              obj({"amount": n(0, 10**9), "from_currency": e("USD", "EUR", "GBP", "JPY"),
                   "to_currency": e("USD", "EUR", "GBP", "JPY")}),
              "How many euros is 250 US dollars?"),
    BenchTool("set_thermostat", "Set the target temperature of a room.",
              obj({"room": e("living_room", "bedroom", "kitchen", "office"), "temperature_c": n(10, 30),
                   "mode": e("heat", "cool", "auto")}, ("room", "temperature_c")),
              "Set the bedroom to 19 degrees please."),
    BenchTool("translate_text", "Translate text between languages.",
              obj({"text": s(200), "source_lang": e("en", "fr", "de", "es", "it"),
                   "target_lang": e("en", "fr", "de", "es", "it")},
                  ("text", "target_lang")),
              "Translate 'good morning, my friend' into Spanish."),
    BenchTool("create_ticket", "Open a ticket in the issue tracker.",
              obj({"title": s(80), "priority": e("low", "medium", "high", "urgent"), "labels": arr(s(20), 0, 3),
                   "assignee": {"anyOf": [s(30), {"type": "null"}]}}, ("title", "priority")),
              "Open an urgent ticket: the login page crashes on Safari."),
    BenchTool("get_directions", "Route between two places.",
              obj({"origin": s(60), "destination": s(60), "mode": e("driving", "walking", "transit", "cycling")},
                  ("origin", "destination")),
              "How do I get from the Louvre to the Eiffel Tower on foot?"),
    BenchTool("calculate_tip", "Tip and share per person of a restaurant bill.",
              obj({"bill_amount": n(0, 100000), "tip_percent": n(0, 100), "split": i(1, 20)}, ("bill_amount", "tip_percent")),
              "Our bill is 84 dollars, we want to tip 18% and split it between 3 people."),
]
