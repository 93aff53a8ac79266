"""Each part's corpus (test_partN_*.py) lists WRONG and RIGHT answers and imports the two tests of
answers.py; here they are given that part's answers, one case each, named by the answer's label."""


def pytest_generate_tests(metafunc):
    module = metafunc.module
    if "wrong" in metafunc.fixturenames:
        metafunc.parametrize("wrong", module.WRONG, ids=[w[1] for w in module.WRONG])
    if "right" in metafunc.fixturenames:
        metafunc.parametrize("right", module.RIGHT, ids=[r[1] for r in module.RIGHT])
