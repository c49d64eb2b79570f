"""Parses OpenMetrics text from stdin with prometheus_client's strict OpenMetrics parser
(tests/common/openmetrics.rs runs it) and prints a JSON summary of the families:
{name: {"type", "unit", "help", "samples": [{"name", "labels", "value", "exemplar"}]}}.
A parse error exits non-zero with the parser's message on stderr."""

import json
import math
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families


def number(v):
    """JSON has no infinities or NaN: those go as text."""
    return v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)


def main() -> None:
    text = sys.stdin.read()
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = {
            "type": family.type,
            "unit": family.unit,
            "help": family.documentation,
            "samples": [
                {
                    "name": s.name,
                    "labels": s.labels,
                    "value": number(s.value),
                    "exemplar": s.exemplar.labels if s.exemplar else None,
                }
                for s in family.samples
            ],
        }
    json.dump(families, sys.stdout)


if __name__ == "__main__":
    main()
