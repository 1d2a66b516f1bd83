"""Every HTTP endpoint the gateway registers is named in the README or docs/, so a new endpoint cannot
ship without a line a user can find (the admin API's are read without their `/admin/api/v1` prefix,
as docs/admin-api.md writes them; path parameters match whatever the doc calls them)."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.app import create_app
from gateway.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "/admin/api/v1"
# The session mirror of the admin API (docs/admin-ui.md says so once for all) and the UI's files.
NOT_EACH = ("/admin/session/api/v1/", "/admin/assets/")


def params_as_braces(text: str) -> str:
    """`/tenants/{tenant_id:str}` and `/tenants/{id}` both read `/tenants/{}`."""
    return re.sub(r"\{[^}]*\}", "{}", text)


def named(path: str, docs: str) -> bool:
    # the whole path, not a prefix of a longer one (`/v1/models` inside `/v1/models/{id}` is no mention)
    for written in {path, path.removeprefix(ADMIN)}:
        if re.search(r"(?<![\w/}])" + re.escape(params_as_braces(written)) + r"(?![\w/{])", docs):
            return True
    return False


def test_every_endpoint_the_app_registers_is_documented(tmp_path: Path) -> None:
    config = parse_config(f"database_url: sqlite:///{tmp_path}/weir.db\n", {})
    paths = {route.path for route in create_app(config).routes if not route.path.startswith(NOT_EACH)}
    assert {"/v1/chat/completions", "/v1/feedback", f"{ADMIN}/tenants", "/admin/session"} <= paths
    docs = params_as_braces(
        "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    )
    undocumented = sorted(path for path in paths if not named(path, docs))
    assert not undocumented, f"endpoints no doc names: {undocumented}"
