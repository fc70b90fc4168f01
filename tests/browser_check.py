"""Read the rendered book in headless Chromium, as a reader would, and fail on what a
reader would trip over.

Usage: ``python tests/browser_check.py [_build/html] [--screenshots DIR]``. Every page of
the built book is opened at 1280 x 900 px, after MathJax has typeset it, and checked for:

* TeX left untypeset (``\\(``, ``\\[``, ``$$`` or ``\\begin{`` in the page's text);
* code, output, maths, tables or figures wider than the text column;
* broken images, and images without a caption;
* plotting code left visible (matplotlib calls in a code cell the reader sees).

Prints one line per problem and exits 1 if there is any. The browser is the system's
Chromium (``/usr/bin/chromium``, or ``CHROMIUM``), driven by playwright; nothing is
downloaded.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import os
import pathlib
import sys
import threading

_SKIP_PAGES = {"genindex.html", "search.html", "py-modindex.html"}

# Runs in the page; returns a list of problems (strings).
_CHECKS_JS = r"""
() => {
  const problems = [];
  const article = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
  const column = article.getBoundingClientRect();
  const visible = (el) => {
    if (!el.getClientRects().length) return false;
    for (let node = el; node; node = node.parentElement) {
      const style = getComputedStyle(node);
      if (style.display === "none" || style.visibility === "hidden") return false;
      if (node.tagName === "DETAILS" && !node.open && !el.closest("summary")) return false;
    }
    return true;
  };
  const describe = (el) => {
    const text = (el.innerText || el.getAttribute("alt") || el.tagName).trim().replace(/\s+/g, " ");
    return el.tagName.toLowerCase() + " '" + text.slice(0, 70) + "'";
  };
  // 1. untypeset TeX
  const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT);
  const tex = /\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{/;
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const parent = node.parentElement;
    if (!parent || parent.closest("pre, code, script, style, mjx-container, .highlight")) continue;
    if (tex.test(node.textContent) && visible(parent)) {
      problems.push("untypeset TeX: '" + node.textContent.trim().slice(0, 80) + "'");
    }
  }
  // 2. blocks wider than the text column
  const blocks = article.querySelectorAll(
    "div.highlight pre, div.cell_output, div.output, mjx-container[display='true'], table, img, figure, div.math");
  for (const el of blocks) {
    if (!visible(el) || getComputedStyle(el).display.startsWith("inline")) continue;
    const box = el.getBoundingClientRect();
    const inner = el.tagName === "MJX-CONTAINER" ? el.firstElementChild : null;
    const width = inner ? inner.getBoundingClientRect().width : Math.max(box.width, el.scrollWidth);
    if (box.left + width > column.right + 2 || el.scrollWidth > el.clientWidth + 2) {
      problems.push("wider than the text column (" + Math.round(width) + " > " +
                    Math.round(column.right - box.left) + " px): " + describe(el));
    }
  }
  // 3. images: loaded, and captioned
  for (const img of article.querySelectorAll("img")) {
    if (!visible(img)) continue;
    if (!img.complete || img.naturalWidth === 0) problems.push("broken image: " + (img.getAttribute("src") || ""));
    const figure = img.closest("figure");
    const caption = figure && figure.querySelector("figcaption");
    if (!caption || !caption.innerText.trim()) {
      problems.push("image without a caption: " + (img.getAttribute("src") || "").split("/").pop());
    }
  }
  // 4. plotting code a reader sees
  const plotting = /\bplt\.|matplotlib|\.savefig\(|\bax\.(plot|bar|set_|scatter|legend)|\bfig\.|subplots\(/;
  for (const cell of article.querySelectorAll("div.cell_input, div.cell div.highlight")) {
    if (visible(cell) && plotting.test(cell.innerText)) {
      problems.push("plotting code visible: '" + cell.innerText.trim().split("\n")[0].slice(0, 70) + "'");
    }
  }
  return [...new Set(problems)];
}
"""

_TYPESET_JS = """
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  return !!(window.MathJax && MathJax.version);
}
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _serve(root: pathlib.Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pages(root: pathlib.Path):
    for path in sorted(root.rglob("*.html")):
        relative = path.relative_to(root)
        if relative.parts[0].startswith("_") or relative.name in _SKIP_PAGES or relative.parts[0] == "reports":
            continue
        yield relative


def check(root: pathlib.Path, screenshots: pathlib.Path | None) -> int:
    from playwright.sync_api import sync_playwright

    server = _serve(root)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    executable = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    failures = 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        # the book must not need a network: any request off this machine fails the page
        offline: list = []
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(base)
                   or route.request.url.startswith("data:") else (offline.append(route.request.url), route.abort()))
        for relative in pages(root):
            offline.clear()
            page.goto(f"{base}/{relative.as_posix()}", wait_until="networkidle")
            page.evaluate(_TYPESET_JS)
            problems = page.evaluate(_CHECKS_JS)
            problems += [f"request off the machine: {url}" for url in dict.fromkeys(offline)]
            if screenshots is not None:
                screenshots.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshots / (relative.as_posix().replace("/", "_") + ".png")),
                                full_page=True)
            status = "ok" if not problems else f"{len(problems)} problem(s)"
            print(f"{relative}: {status}")
            for problem in problems:
                print(f"    {problem}")
            failures += len(problems)
        browser.close()
    server.shutdown()
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default="_build/html", help="the built book (default: _build/html)")
    parser.add_argument("--screenshots", default=None, help="write a full-page PNG of every page here")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.root)
    if not (root / "index.html").exists():
        print(f"no built book at {root}: build it first (bash .ci/book)", file=sys.stderr)
        return 2
    failures = check(root, pathlib.Path(args.screenshots) if args.screenshots else None)
    print(f"{failures} problem(s)" if failures else "every page reads cleanly")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
