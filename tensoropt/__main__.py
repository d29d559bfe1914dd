from tensoropt.cli import console

console()
