"""Official SDKs through the gateway: only the base URL changes and NM-Key is added.

Run by tests/sdk.rs (which starts the gateway and mock providers) with NM_GATEWAY and NM_KEY set.
Checks a plain call and, for OpenAI, a stream, and that a wrong NM-Key raises each SDK's own
authentication exception. Exits non-zero with a message on the first failure.
"""

import os
import sys

import anthropic
import openai
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

GW = os.environ["NM_GATEWAY"]
KEY = os.environ["NM_KEY"]
HEADERS = {"NM-Key": KEY, "NM-Agent": "sdk-check", "NM-Session": "sess_sdk1", "NM-Env": "development"}
BAD = {"NM-Key": "nmk_wrong"}


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")
    print(f"ok: {what}")


def openai_sdk():
    client = openai.OpenAI(base_url=f"{GW}/openai/v1", api_key="sk-client", default_headers=HEADERS)
    r = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hallo"}])
    check(r.choices[0].message.content == "Hallo, Welt! 🌍", "openai chat completion")

    stream_client = openai.OpenAI(base_url=f"{GW}/openai-stream/v1", api_key="sk-client", default_headers=HEADERS)
    chunks = list(stream_client.chat.completions.create(model="gpt-4o-mini", messages=[], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == "Hallo 🌍", f"openai stream ({len(chunks)} chunks)")

    bad = openai.OpenAI(base_url=f"{GW}/openai/v1", api_key="sk-client", default_headers=BAD, max_retries=0)
    try:
        bad.chat.completions.create(model="gpt-4o-mini", messages=[])
        check(False, "openai raises AuthenticationError on a wrong NM-Key")
    except openai.AuthenticationError as e:
        check(e.status_code == 401 and e.code == "invalid_api_key", "openai raises AuthenticationError on a wrong NM-Key")


def anthropic_sdk():
    client = anthropic.Anthropic(base_url=f"{GW}/anthropic", api_key="sk-ant-client", default_headers=HEADERS)
    m = client.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "Ça va?"}])
    check(m.content[0].text == "Ça va bien, merci !", "anthropic message")
    bad = anthropic.Anthropic(base_url=f"{GW}/anthropic", api_key="sk-ant-client", default_headers=BAD, max_retries=0)
    try:
        bad.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        check(False, "anthropic raises AuthenticationError on a wrong NM-Key")
    except anthropic.AuthenticationError as e:
        check(e.status_code == 401, "anthropic raises AuthenticationError on a wrong NM-Key")


def gemini_sdk():
    client = genai.Client(api_key="g-client", http_options=types.HttpOptions(base_url=f"{GW}/gemini", headers=HEADERS))
    r = client.models.generate_content(model="gemini-2.0-flash", contents="Wie spät ist es?")
    check(r.text == "Ich habe keine Uhr. ⏰", "gemini generate_content")
    bad = genai.Client(api_key="g-client", http_options=types.HttpOptions(base_url=f"{GW}/gemini", headers=BAD))
    try:
        bad.models.generate_content(model="gemini-2.0-flash", contents="x")
        check(False, "gemini raises ClientError on a wrong NM-Key")
    except genai_errors.ClientError as e:
        check(e.code == 401 and e.status == "UNAUTHENTICATED", "gemini raises ClientError(401, UNAUTHENTICATED) on a wrong NM-Key")


openai_sdk()
anthropic_sdk()
gemini_sdk()
print("all SDK checks passed")
