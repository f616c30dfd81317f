// Catch2 2.13's main, compiled once into a small library shared by every test executable.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
