"""Prints the mrtr_gateway_* metric names a Grafana dashboard queries, one per line,
sorted, with the histogram suffixes _bucket, _sum and _count removed, so the list can be
compared with what a running gateway exports on /metrics.

Usage: dashboard_metrics.py DASHBOARD.json [OUTPUT]
"""

import json
import re
import sys

METRIC = re.compile(r"mrtr_gateway_[a-z_]+")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def queries(node):
    """Every PromQL string in the dashboard: panel targets' `expr`, and template
    variables' `query` (a string, or an object holding one)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def metric_names(dashboard):
    names = set()
    for query in queries(dashboard):
        for name in METRIC.findall(query):
            names.add(HISTOGRAM_SUFFIX.sub("", name))
    return sorted(names)


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit(__doc__.strip())
    with open(argv[1]) as f:
        names = metric_names(json.load(f))
    if not names:
        sys.exit(f"{argv[1]}: no mrtr_gateway_* metric in any query")
    text = "".join(name + "\n" for name in names)
    if len(argv) == 3:
        with open(argv[2], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv)
