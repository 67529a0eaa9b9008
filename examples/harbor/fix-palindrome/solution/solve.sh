#!/bin/bash
cat > palindrome.py <<'PY'
def is_palindrome(text):
    kept = [ch.lower() for ch in text if ch.isalnum()]
    return kept == kept[::-1]
PY
