"""Start the server: `python launch_server.py [--model-path DIR] [flags]`.

The same as `python -m srt.launch_server`; `--help` lists the flags.
"""

from srt.launch_server import main

if __name__ == "__main__":
    main()
