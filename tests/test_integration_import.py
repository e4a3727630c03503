"""Importing the transformers integration without transformers names the extra to install."""
import subprocess
import sys


def test_missing_transformers_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import kerngen.integrations.transformers\n"
            "except ModuleNotFoundError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'kerngen[transformers]'" in out and "transformers 5" in out
