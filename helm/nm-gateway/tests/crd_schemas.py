"""Strict schemas for the custom resources the chart can render.

kubernetes-validate ships only the built-in kinds. These are the parts of the upstream CRDs'
openAPIV3Schema that the chart writes (monitoring.coreos.com/v1 ServiceMonitor and PodMonitor of
the Prometheus Operator; cert-manager.io/v1 Certificate), transcribed field by field with their
types and enums and `additionalProperties: false`, so a misspelt or misplaced field fails here
instead of being dropped by the API server's pruning.
"""

from __future__ import annotations

from typing import Any

import jsonschema

_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_GO_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h))+$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    "additionalProperties": False,
}
_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": _LABELS,
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
    "additionalProperties": False,
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
    "additionalProperties": False,
}
_ENDPOINT = {
    "type": "object",
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": {"type": "object"}},
        "metricRelabelings": {"type": "array", "items": {"type": "object"}},
    },
    "additionalProperties": False,
}


def _resource(api: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": spec,
        },
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _resource(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                "jobLabel": {"type": "string"},
            },
            "additionalProperties": False,
        },
    ),
    "PodMonitor": _resource(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                "jobLabel": {"type": "string"},
            },
            "additionalProperties": False,
        },
    ),
    "Certificate": _resource(
        "cert-manager.io/v1",
        "Certificate",
        {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "properties": {
                "secretName": {"type": "string"},
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": {"type": "array", "items": {"type": "string"}},
                "duration": _GO_DURATION,
                "renewBefore": _GO_DURATION,
                "privateKey": {
                    "type": "object",
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    },
                    "additionalProperties": False,
                },
                "usages": {
                    "type": "array",
                    "items": {
                        "enum": [
                            "signing", "digital signature", "content commitment", "key encipherment",
                            "key agreement", "data encipherment", "cert sign", "crl sign",
                            "encipher only", "decipher only", "any", "server auth", "client auth",
                            "code signing", "email protection", "s/mime", "ipsec end system",
                            "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
                            "microsoft sgc", "netscape sgc",
                        ]
                    },
                },
                "issuerRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "kind": {"type": "string"},
                        "group": {"type": "string"},
                    },
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
        },
    ),
}


def validate(doc: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError; KeyError for a kind without a schema here."""
    jsonschema.validate(doc, SCHEMAS[doc["kind"]])
