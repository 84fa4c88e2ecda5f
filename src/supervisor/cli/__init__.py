"""The command line: commands, tables, the chat loop and the demo."""
