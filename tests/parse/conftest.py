"""``--update-goldens`` rewrites the expected diagnostics of grammar/invalid/ from the current output."""


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite grammar/invalid/*.expected from the current diagnostics",
    )
