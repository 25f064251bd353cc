"""The Gradio Space (`app.py`), also importable as `angelspec_hf.spaces_demo` for `angelspec demo`."""
