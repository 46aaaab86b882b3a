#include <catch2/catch.hpp>

#include "tokenizer/tokenizer.h"
