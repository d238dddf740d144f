"""Tenants: hashed keys, permissions, file parsing."""

from __future__ import annotations

import pytest

from lorafleet.router.tenants import ANONYMOUS, TenantRegistry, hash_api_key

DOC = {
    "tenants": [
        {
            "name": "acme",
            "api_key_sha256": [hash_api_key("k1"), "sha256:" + hash_api_key("k2")],
            "adapters": ["a"],
        },
        {"name": "beta", "api_key_sha256": hash_api_key("k3"), "adapters": "*", "models": ["m"]},
    ]
}


@pytest.mark.parametrize(
    ("header", "tenant"),
    [
        ("Bearer k1", "acme"),
        ("bearer k2", "acme"),
        ("Bearer k3", "beta"),
        ("Bearer nope", None),
        ("Bearer ", None),
        ("Basic k1", None),
        (None, None),
    ],
)
def test_authenticate(header, tenant):
    found = TenantRegistry.parse(DOC).authenticate(header)
    assert (found.name if found else None) == tenant


def test_permissions():
    reg = TenantRegistry.parse(DOC)
    acme, beta = reg.authenticate("Bearer k1"), reg.authenticate("Bearer k3")
    assert acme.may_use_adapter("a") and not acme.may_use_adapter("b") and acme.may_use_model("anything")
    assert beta.may_use_adapter("zzz") and beta.may_use_model("m") and not beta.may_use_model("other")


def test_open_mode_is_anonymous():
    assert TenantRegistry.open_mode().authenticate(None) is ANONYMOUS


@pytest.mark.parametrize(
    "doc",
    [
        {"tenants": [{"name": "x", "api_key_sha256": "not-hex"}]},
        {
            "tenants": [
                {"name": "x", "api_key_sha256": hash_api_key("k")},
                {"name": "y", "api_key_sha256": hash_api_key("k")},
            ]
        },
    ],
)
def test_bad_files_are_refused(doc):
    with pytest.raises(ValueError):
        TenantRegistry.parse(doc)


def test_yaml_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(
        f"tenants:\n  - name: acme\n    api_key_sha256: [{hash_api_key('k')}]\n    max_concurrency: 2\n"
    )
    tenant = TenantRegistry.from_file(path).authenticate("Bearer k")
    assert tenant.name == "acme" and tenant.max_concurrency == 2 and tenant.adapters is None
