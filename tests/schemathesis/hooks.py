"""Rules between two fields of a request, which JSON Schema cannot state, taught to schemathesis's
generator (its documented way for "schema constraints differ from real validation": extend the
generators to match the runtime rules). Each rule is also in the OpenAPI document, in the field's
description, and the broker's refusal of a request that breaks it is tested in the Rust suite
(`broker/tests/it/api.rs`, `tests/e2e/dashboard.rs`). Only these rules are taught: everything
else the server refuses must be stated in the document, or schemathesis reports it.

Loaded by `scripts/api-contract` through SCHEMATHESIS_HOOKS.
"""

import json
import os
import urllib.request
from datetime import datetime, timezone

import schemathesis


def _market_now():
    """The broker's market clock (`GET /v1/sim/clock`): `to` defaults to it, not to this
    machine's. Schemathesis may move it (it holds the clock too), so it is read each time."""
    req = urllib.request.Request(
        os.environ["PROTEUS_CONTRACT_URL"] + "/v1/sim/clock",
        headers={"Authorization": "Bearer " + os.environ["PROTEUS_CONTRACT_TOKEN"]},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return _instant(json.load(resp)["now"])


def _instant(text):
    """A `from`/`to` value as the broker reads it (RFC 3339 or YYYY-MM-DD, midnight UTC), or
    None when Python cannot read it (then the case is kept: the server must answer it)."""
    if not isinstance(text, str):
        return None
    try:
        if len(text) == 10:
            return datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=timezone.utc)
        parsed = datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return parsed


# `filter_case`, not `filter_query`/`filter_body`: every phase (the coverage phase too) runs it.
@schemathesis.hook("filter_case").apply_to(path="/v1/markets/chart", method="GET")
def chart_window_is_not_empty(ctx, case):
    """`from` before `to` (the chart's window is [from, to)); `to` defaults to market now."""
    query = case.query
    if not isinstance(query, dict) or query.get("from") is None:
        return True
    start = _instant(query.get("from"))
    end = _instant(query["to"]) if query.get("to") is not None else _market_now()
    if start is None or end is None:
        return True
    return start < end


@schemathesis.hook("filter_case").apply_to(path="/v1/jobs", method="POST").apply_to(
    path="/v1/jobs/dry-run", method="POST"
)
def reliable_cap_within_instance_cap(ctx, case):
    """`limits.max_reliable_instances` at most `limits.max_instances`."""
    body = case.body
    limits = body.get("limits") if isinstance(body, dict) else None
    if not isinstance(limits, dict):
        return True
    reliable, total = limits.get("max_reliable_instances"), limits.get("max_instances")
    if not isinstance(reliable, (int, float)) or not isinstance(total, (int, float)):
        return True
    return reliable <= total
