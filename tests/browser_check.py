"""Read the rendered book in headless Chromium, as a reader would, and fail on what a
reader would trip over.

Usage: ``python tests/browser_check.py [_build/html] [--screenshots DIR]``. Every page of
the built book is opened at 1280 x 900 px and at a 390 px phone's width, after MathJax has
typeset it, and checked for:

* TeX left untypeset (``\\(``, ``\\[``, ``$$`` or ``\\begin{`` in the page's text);
* maths, tables or figures wider than the text column, and code or output blocks that
  run past it instead of scrolling inside it;
* code blocks that wrap their lines (a wrapped line breaks Python's indentation);
* a page wider than the window (at 390 px, a phone scrolls sideways);
* broken images, images without a caption, and alt text that is a file name;
* plotting code left visible (matplotlib calls in a code cell the reader sees);
* on a chapter: more than 2,500 words of prose, or more than 8 timings stated in it.

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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import book_rules  # noqa: E402

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
    return el.tagName.toLowerCase() + " '" + Array.from(text).slice(0, 70).join("") + "'";
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
    // a block that scrolls sideways inside itself (code, a table, display maths) may hold
    // more than the column shows, as long as its own box stays inside the column
    const scrolls = ["PRE", "TABLE", "MJX-CONTAINER"].includes(el.tagName)
      && ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
    const width = scrolls ? box.width : (inner ? inner.getBoundingClientRect().width : Math.max(box.width, el.scrollWidth));
    if (box.left + width > column.right + 2 || (!scrolls && el.scrollWidth > el.clientWidth + 2)) {
      problems.push("wider than the text column (" + Math.round(width) + " > " +
                    Math.round(column.right - box.left) + " px): " + describe(el));
    }
  }
  // 2b. code blocks scroll, never wrap
  for (const pre of article.querySelectorAll("div.highlight pre")) {
    if (visible(pre) && getComputedStyle(pre).whiteSpace !== "pre") {
      problems.push("code block wraps its lines (white-space: " + getComputedStyle(pre).whiteSpace + "): " + describe(pre));
    }
  }
  // 2c. the page fits the window
  const pageWidth = document.documentElement.scrollWidth;
  if (pageWidth > window.innerWidth + 1) {
    problems.push("page wider than the window (" + pageWidth + " > " + window.innerWidth + " px)");
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
    const alt = (img.getAttribute("alt") || "").trim();
    if (!alt || /\.(png|svg|jpe?g|gif|webp)$/i.test(alt) || /^[\w.\/-]+$/.test(alt)) {
      problems.push("alt text is not a description: '" + alt.slice(0, 60) + "'");
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

# Runs in the page; returns the text of its prose: paragraphs and list items outside
# code, outputs, figures, tables and the closing References section, with maths left out.
_PROSE_JS = r"""
() => {
  const article = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
  const references = [...article.querySelectorAll("section")].find(
    (s) => /^References/.test((s.querySelector("h1, h2, h3") || {}).innerText || ""));
  const parts = [];
  for (const el of article.querySelectorAll("p, li, dt, dd")) {
    if (el.closest("figure, table, div.cell_output, div.highlight, nav, dl.glossary, div.admonition.seealso")) continue;
    if (references && references.contains(el)) continue;
    if (el.tagName === "LI" && el.querySelector("p")) continue;  // its paragraphs count
    const copy = el.cloneNode(true);
    copy.querySelectorAll("mjx-container, ul, ol").forEach((n) => n.remove());
    parts.push(copy.textContent);
  }
  return parts.join("\n");
}
"""

_CHAPTERS = {f"book/{chapter}.html" for chapter in book_rules.CHAPTERS}
_VIEWPORTS = ((1280, 900), (390, 844))

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
        for width, height in _VIEWPORTS:
            page = browser.new_page(viewport={"width": width, "height": height})
            # the book must not need a network: any request off this machine fails the page
            offline: list = []
            page.route("**/*", lambda route, offline=offline: route.continue_()
                       if route.request.url.startswith(base) or route.request.url.startswith("data:")
                       else (offline.append(route.request.url), route.abort()))
            for relative in pages(root):
                offline.clear()
                page.goto(f"{base}/{relative.as_posix()}", wait_until="networkidle")
                page.evaluate(_TYPESET_JS)
                problems = page.evaluate(_CHECKS_JS)
                problems += [f"request off the machine: {url}" for url in dict.fromkeys(offline)]
                note = ""
                if relative.as_posix() in _CHAPTERS and width == _VIEWPORTS[0][0]:
                    prose = page.evaluate(_PROSE_JS)
                    words = book_rules.words(prose)
                    timings = book_rules.TIMING.findall(prose)
                    note = f" ({words} words of prose, {len(timings)} timings)"
                    if words > book_rules.MAX_PROSE_WORDS:
                        problems.append(f"{words} words of prose (at most {book_rules.MAX_PROSE_WORDS})")
                    if len(timings) > book_rules.MAX_TIMINGS_IN_PROSE:
                        problems.append(f"{len(timings)} timings in prose (at most "
                                        f"{book_rules.MAX_TIMINGS_IN_PROSE}): {timings}")
                if screenshots is not None:
                    screenshots.mkdir(parents=True, exist_ok=True)
                    name = relative.as_posix().replace("/", "_")
                    page.screenshot(path=str(screenshots / f"{name}.{width}.png"), full_page=True)
                status = "ok" if not problems else f"{len(problems)} problem(s)"
                print(f"{relative} at {width} px: {status}{note}")
                for problem in problems:
                    print("    " + problem.encode("utf-8", "backslashreplace").decode("utf-8"))
                failures += len(problems)
            page.close()
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
