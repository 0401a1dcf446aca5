"""The constraints the structured-output acceptance tests sample against: ten
JSON schemas covering nested objects, arrays with min/max items, enums, bounded
numbers, required and optional fields and string patterns, plus a regex and a
choice list. Shared by the library and server tests."""

from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 25},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "tags_array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum_color": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "shade": {"type": "string", "enum": ["light", "dark"]},
        },
        "required": ["color", "shade"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "subtitle": {"type": "string", "maxLength": 40},
            "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        },
        "required": ["code", "phone"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "booleans_and_null": {
        "type": "object",
        "properties": {
            "active": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 20},
        },
        "required": ["active", "note"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {"type": "array", "minItems": 2, "maxItems": 3,
                          "items": {"type": "integer", "minimum": -9, "maximum": 9}},
            },
            "label": {"enum": ["a", "b"]},
        },
        "required": ["rows", "label"],
        "additionalProperties": False,
    },
}

REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
CHOICES = ["Paris", "London", "Berlin", "New York City"]


def prompt_for(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a JSON object for a {name.replace('_', ' ')}."}]
