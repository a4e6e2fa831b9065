"""The request body, checked as it arrives, before Starlette parses it: its size, and a form's text as UTF-8."""

from __future__ import annotations

import codecs
from urllib.parse import unquote_to_bytes

from python_multipart import MultipartParser, QuerystringParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from replicadp_tasks.settings import SETTINGS

from .errors import ErrorCode, GatewayError, error_response

FORM_ALLOWANCE = 1024 * 1024  # a body may exceed the image limit by this (text fields, multipart framing)


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"input_reference: request body over {limit} bytes; a first frame may have at most "
                             f"{SETTINGS.max_image_bytes} bytes (REPLICADP_MAX_IMAGE_BYTES)",
                        code=ErrorCode.TOO_LARGE, param="input_reference")


def not_utf8(field: bytes, exc: UnicodeDecodeError, offset: int) -> GatewayError:
    name = field.decode(errors="backslashreplace")
    return GatewayError(400, f"{name}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {offset} of the "
                             "value); form values must be UTF-8", code=ErrorCode.INVALID_REQUEST, param=name)


class FormText:
    """The form's field names and text values, checked as UTF-8 from the raw body as it arrives, beside
    Starlette's own parser: Starlette decodes a multipart value that is not UTF-8 as Latin-1, and an urlencoded
    one with U+FFFD in place of the bad bytes, without a word, so the decoded form cannot tell. `feed` raises
    a 400 naming the first field that is not UTF-8. File parts are not checked (nor kept)."""

    def __init__(self, content_type: bytes):
        kind, params = parse_options_header(content_type)
        self.parser = None
        if kind not in (b"multipart/form-data", b"application/x-www-form-urlencoded"):
            return  # no form: Starlette reads none either
        charset = params.get(b"charset", b"utf-8").decode("latin-1")
        try:
            charset_ok = codecs.lookup(charset).name == "utf-8"
        except LookupError:
            charset_ok = False
        if not charset_ok:
            raise GatewayError(400, f"Content-Type: charset={charset!r}; form values must be UTF-8",
                               code=ErrorCode.INVALID_REQUEST)
        try:
            if kind == b"multipart/form-data" and b"boundary" in params:
                self.parser = MultipartParser(params[b"boundary"], {
                    "on_part_begin": self._begin, "on_header_field": self._header_field,
                    "on_header_value": self._header_value, "on_header_end": self._header_end,
                    "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
                    "on_part_end": self._part_end})
            elif kind == b"application/x-www-form-urlencoded":
                self.parser = QuerystringParser({"on_field_start": self._begin, "on_field_name": self._field_name,
                                                 "on_field_data": self._field_data, "on_field_end": self._field_end})
        except FormParserError:  # malformed (here and in feed): Starlette's parser refuses it with its own 400
            self.parser = None

    def feed(self, chunk: bytes) -> None:
        if self.parser is not None and chunk:
            try:
                self.parser.write(chunk)
            except FormParserError:
                self.parser = None

    def _begin(self) -> None:
        self.name, self.header, self.value, self.disposition, self.raw = b"", b"", b"", b"", bytearray()
        self.decoder, self.seen = codecs.getincrementaldecoder("utf-8")(), 0

    # multipart: a part's Content-Disposition names it (and says whether it is a file); its text is decoded
    # incrementally, so a value is never held whole. A header may arrive in pieces.
    def _header_field(self, data, start, end) -> None:
        self.header += data[start:end]

    def _header_value(self, data, start, end) -> None:
        self.value += data[start:end]

    def _header_end(self) -> None:
        if self.header.lower() == b"content-disposition":
            self.disposition = self.value
        self.header, self.value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        self.name = options.get(b"name", b"")
        self._check_name()
        if b"filename" in options:
            self.decoder = None

    def _part_data(self, data, start, end) -> None:
        if self.decoder is not None:
            self._decode(bytes(data[start:end]), final=False)

    def _part_end(self) -> None:
        if self.decoder is not None:
            self._decode(b"", final=True)

    def _decode(self, data: bytes, final: bool) -> None:
        pending = len(self.decoder.getstate()[0])  # bytes of a character begun in an earlier chunk
        try:
            self.decoder.decode(data, final)
        except UnicodeDecodeError as exc:
            raise not_utf8(self.name, exc, self.seen - pending + exc.start) from None
        self.seen += len(data)

    # urlencoded: percent-escapes may straddle chunks, so a field is decoded once it ends.
    def _field_name(self, data, start, end) -> None:
        self.name += data[start:end]

    def _field_data(self, data, start, end) -> None:
        self.raw += data[start:end]

    def _field_end(self) -> None:
        self.name = self._unquote(self.name, b"")
        self._check_name()
        try:
            self._unquote(bytes(self.raw), self.name).decode()
        except UnicodeDecodeError as exc:
            raise not_utf8(self.name, exc, exc.start) from None

    def _unquote(self, raw: bytes, field: bytes) -> bytes:
        if not raw.isascii():  # Starlette would read the raw bytes as Latin-1, even valid UTF-8
            name = field.decode(errors="backslashreplace") if field else None
            raise GatewayError(400, f"{name or 'a field name'}: bytes past ASCII in an urlencoded form; "
                                    "percent-encode them (%C3%A9) or send multipart/form-data",
                               code=ErrorCode.INVALID_REQUEST, param=name)
        return unquote_to_bytes(raw.replace(b"+", b" "))

    def _check_name(self) -> None:
        try:
            self.name.decode()
        except UnicodeDecodeError as exc:
            raise GatewayError(400, f"field name {self.name!r}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at "
                                    f"offset {exc.start}); form field names must be UTF-8",
                               code=ErrorCode.INVALID_REQUEST,
                               param=self.name.decode(errors="backslashreplace")) from None


class BodyCheck:
    """ASGI middleware: refuse a request body past `limit` bytes while it arrives (Starlette would spool an
    upload of any size to a temporary file before the endpoint could look at it), and check a form's text as
    it arrives (FormText)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            err = too_large(self.limit)
            return await error_response(413, err.detail, err.code, err.param)(scope, receive, send)
        seen = 0
        form = None

        async def checked():
            nonlocal seen, form
            message = await receive()
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:  # a chunked body, which declares no length
                raise too_large(self.limit)
            if form is None:  # the endpoint reads the body: a form route
                form = FormText(headers.get(b"content-type", b""))
            form.feed(body)
            return message

        await self.app(scope, checked, send)
