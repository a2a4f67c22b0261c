"""The web app at `/`: documents, chat and settings in a browser, on top of the public API.

Plain HTML, one CSS file and a few ES modules shipped in the package (ragkv/api/static/web):
no CDN, no build step. The page is served with a Content-Security-Policy that allows
scripts, styles and requests from this server only (no inline script, no eval, no plugins,
no framing), so data that slipped into the page as markup would still not run; the scripts
themselves write every document text and model output with textContent, never as HTML.
The page holds no data of its own: it calls /v1/ with the API key the user gives it (kept
in the browser, sent as the bearer token), so a tenant sees what the API shows it.
/docs keeps its own headers (the Swagger UI needs an inline script).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_ASSETS = Path(__file__).resolve().parent / "static" / "web"
ASSETS_PATH = "/ui"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class _Assets(StaticFiles):
    """The page's scripts and styles, with the page's headers (a module is fetched as it is)."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


def install_web(app: FastAPI) -> None:
    """The page at `/` and its assets under /ui/."""
    app.mount(ASSETS_PATH, _Assets(directory=WEB_ASSETS), name="web-assets")

    @app.get("/", include_in_schema=False)
    def web_page() -> FileResponse:
        return FileResponse(WEB_ASSETS / "index.html", media_type="text/html", headers=PAGE_HEADERS)
