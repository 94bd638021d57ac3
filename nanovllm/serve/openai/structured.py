"""OpenAI's response_format and vLLM's structured_outputs field, as StructuredOutputsParams."""
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.serve.openai.validation import FieldError

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")  # OpenAI's json_schema object
# vLLM's StructuredOutputsParams fields a request may set
STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object",
                     "disable_any_whitespace")


def response_format_params(value: dict | None) -> StructuredOutputsParams | None:
    """{"type": "text"} (or None) is free text; "json_object" any JSON object; "json_schema"
    its json_schema.schema (strict or not: the output always conforms)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise FieldError("response_format", f"response_format.type={kind!r}: expected one of "
                                            f"{RESPONSE_FORMATS}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise FieldError("response_format", "response_format.json_schema must be an object "
                                            "with a string `name` (and `schema`, `strict`)")
    schema = spec.get("schema", {})  # OpenAI's SDK sends it; absent means any JSON
    if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), bool | None):
        raise FieldError("response_format", "response_format.json_schema: `schema` must be an "
                                            "object and `strict` a bool")
    return StructuredOutputsParams(json=schema)


def response_format_unknown(value: dict | None) -> list[str]:
    """The keys of response_format that nothing reads, as dotted paths, for the server's log
    (as vLLM names them)."""
    if not isinstance(value, dict):
        return []
    found = [f"response_format.{key}" for key in value if key not in ("type", "json_schema")]
    spec = value.get("json_schema")
    if isinstance(spec, dict):
        found += [f"response_format.json_schema.{key}" for key in spec
                  if key not in JSON_SCHEMA_KEYS]
    return found


def structured_outputs_params(value: dict | None) -> StructuredOutputsParams | None:
    """vLLM's structured_outputs extra field: StructuredOutputsParams' own names."""
    if value is None:
        return None
    unknown = sorted(set(value) - set(STRUCTURED_FIELDS))
    if unknown:
        raise FieldError("structured_outputs", f"structured_outputs: unknown key(s) {unknown}; "
                                               f"expected some of {STRUCTURED_FIELDS}")
    try:
        return StructuredOutputsParams(**value)
    except ValueError as e:
        raise FieldError("structured_outputs", str(e)) from None


def requested_structure(response_format: dict | None, structured_outputs: dict | None
                        ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the params, the field that set them): at most one of the two fields constrains."""
    from_format = response_format_params(response_format)
    from_extra = structured_outputs_params(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise FieldError("structured_outputs", "structured_outputs and a response_format "
                                               "other than text cannot be used together")
    if from_format is not None:
        return from_format, "response_format"
    if from_extra is not None:
        return from_extra, "structured_outputs"
    return None, None


def check_compiles(grammars: object, params: StructuredOutputsParams, field: str) -> None:
    """A FieldError naming `field` when the grammar does not compile (`grammars` is a
    StructuredOutputs; compiled ones are cached for the request)."""
    try:
        grammars.compile(params)
    except ValueError as e:
        raise FieldError(field, f"{field}: {e}") from None

