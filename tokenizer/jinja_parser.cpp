#include "tokenizer/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "tokenizer/jinja_lexer.h"

namespace moe::jinja {

namespace {

std::string describe(const Token& t) {
  switch (t.kind) {
    case TokenKind::Data:
      return "template text";
    case TokenKind::VarBegin:
      return "'{{'";
    case TokenKind::VarEnd:
      return "'}}'";
    case TokenKind::BlockBegin:
      return "'{%'";
    case TokenKind::BlockEnd:
      return "'%}'";
    case TokenKind::Name:
      return "'" + t.text + "'";
    case TokenKind::String:
      return "a string";
    case TokenKind::Int:
    case TokenKind::Float:
      return "a number";
    case TokenKind::Op:
      return "'" + t.text + "'";
    case TokenKind::End:
      return "the end of the template";
  }
  return "a token";
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Program run() {
    Program program;
    program.body = subparse({}, "", 0);
    return program;
  }

 private:
  // ---- token stream --------------------------------------------------------
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(size_t ahead = 1) const {
    return toks_[std::min(pos_ + ahead, toks_.size() - 1)];
  }
  const Token& next() {
    const Token& t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool is_op(const char* op) const { return cur().kind == TokenKind::Op && cur().text == op; }
  bool is_name(const char* name) const {
    return cur().kind == TokenKind::Name && cur().text == name;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  [[noreturn]] void fail(const std::string& msg) const { throw TemplateError(msg, cur().line); }
  [[noreturn]] void unexpected(const std::string& expected) const {
    fail("expected " + expected + ", got " + describe(cur()));
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) unexpected(std::string("'") + op + "'");
  }
  void expect_block_end() {
    if (cur().kind != TokenKind::BlockEnd) unexpected("end of statement '%}'");
    next();
  }
  std::string expect_name() {
    if (cur().kind != TokenKind::Name) unexpected("a name");
    return next().text;
  }

  // Bounds the recursion of both this parser and the evaluator over its tree.
  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxParseDepth)
        p_.fail("template nested too deeply (more than " + std::to_string(kMaxParseDepth) +
                " levels)");
    }
    ~DepthGuard() { --p_.depth_; }
    Parser& p_;
  };

  // Records the subtree's height from its direct children and refuses trees
  // taller than kMaxExprDepth. Called on every node that wraps others.
  ExprPtr seal(ExprPtr e) {
    int h = 0;
    auto see = [&](const ExprPtr& c) {
      if (c) h = std::max(h, c->depth);
    };
    see(e->object), see(e->lhs), see(e->rhs), see(e->cond), see(e->start), see(e->stop),
        see(e->step);
    for (const auto& c : e->items) see(c);
    for (const auto& c : e->keys) see(c);
    for (const auto& kv : e->kwargs) see(kv.second);
    e->depth = h + 1;
    if (e->depth > kMaxExprDepth)
      throw TemplateError(
          "expression nested too deeply (more than " + std::to_string(kMaxExprDepth) + " levels)",
          e->line);
    return e;
  }

  ExprPtr make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // ---- statements ----------------------------------------------------------

  // Parses statements up to a `{% <end> %}` tag whose name is in `ends`; on
  // return the current token is that name (the `{%` is consumed).
  Body subparse(std::initializer_list<const char*> ends, const std::string& opener,
                int opener_line) {
    DepthGuard guard(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == TokenKind::End) {
        if (ends.size() == 0) return body;
        std::string want = *ends.begin();
        for (const char* e : ends)
          if (std::string(e).rfind("end", 0) == 0) want = e;
        throw TemplateError("unexpected end of template: '" + opener + "' opened on line " +
                                std::to_string(opener_line) + " is never closed with '" + want +
                                "'",
                            t.line);
      }
      if (t.kind == TokenKind::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Text;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.kind == TokenKind::VarBegin) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Output;
        s->line = t.line;
        next();
        s->expr = parse_tuple(true);
        if (cur().kind != TokenKind::VarEnd) unexpected("end of print statement '}}'");
        next();
        body.push_back(std::move(s));
      } else if (t.kind == TokenKind::BlockBegin) {
        next();
        if (cur().kind == TokenKind::Name)
          for (const char* e : ends)
            if (cur().text == e) return body;
        body.push_back(parse_statement());
      } else {
        unexpected("a template tag");
      }
    }
  }

  StmtPtr parse_statement() {
    const int line = cur().line;
    if (cur().kind != TokenKind::Name) unexpected("a statement name");
    const std::string tag = next().text;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (tag == "if") {
      parse_if(*s, line);
    } else if (tag == "for") {
      parse_for(*s, line);
    } else if (tag == "set") {
      parse_set(*s, line);
    } else if (tag == "macro") {
      parse_macro(*s, line);
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) throw TemplateError("'" + tag + "' outside of a loop", line);
      s->kind = tag == "break" ? StmtKind::Break : StmtKind::Continue;
      expect_block_end();
    } else if (tag == "filter") {
      s->kind = StmtKind::FilterBlock;
      parse_filter_chain(s->filters);
      expect_block_end();
      s->body = subparse({"endfilter"}, "filter", line);
      next();
      expect_block_end();
    } else if (tag == "generation") {
      // Marks the assistant's part for training masks; renders its body as is.
      s->kind = StmtKind::Scope;
      expect_block_end();
      s->body = subparse({"endgeneration"}, "generation", line);
      next();
      expect_block_end();
    } else if (tag == "elif" || tag == "else" || tag.rfind("end", 0) == 0) {
      throw TemplateError("unexpected '" + tag + "' (no open block it could close)", line);
    } else if (tag == "include" || tag == "import" || tag == "from" || tag == "extends" ||
               tag == "block" || tag == "call" || tag == "with" || tag == "autoescape" ||
               tag == "do" || tag == "trans") {
      throw TemplateError("the '" + tag + "' tag is not supported in chat templates", line);
    } else {
      throw TemplateError("unknown tag '" + tag + "'", line);
    }
    return s;
  }

  void parse_if(Stmt& s, int line) {
    s.kind = StmtKind::If;
    while (true) {
      s.conds.push_back(parse_expression(false));
      expect_block_end();
      s.bodies.push_back(subparse({"elif", "else", "endif"}, "if", line));
      std::string tag = next().text;
      if (tag == "elif") continue;
      if (tag == "else") {
        expect_block_end();
        s.else_body = subparse({"endif"}, "if", line);
        next();
      }
      expect_block_end();
      return;
    }
  }

  void parse_targets(std::vector<std::string>& targets) {
    bool paren = skip_op("(");
    targets.push_back(expect_name());
    while (skip_op(",")) {
      if (cur().kind != TokenKind::Name || is_name("in")) break;
      targets.push_back(expect_name());
    }
    if (paren) expect_op(")");
  }

  void parse_for(Stmt& s, int line) {
    s.kind = StmtKind::For;
    parse_targets(s.targets);
    if (!skip_name("in")) unexpected("'in'");
    s.expr = parse_tuple(false);
    if (skip_name("if")) s.cond = parse_expression(true);
    if (is_name("recursive")) fail("recursive loops are not supported in chat templates");
    expect_block_end();
    ++loop_depth_;
    s.body = subparse({"endfor", "else"}, "for", line);
    --loop_depth_;
    if (next().text == "else") {
      expect_block_end();
      s.else_body = subparse({"endfor"}, "for", line);
      next();
    }
    expect_block_end();
  }

  void parse_set(Stmt& s, int line) {
    s.kind = StmtKind::Set;
    if (cur().kind == TokenKind::Name && peek().kind == TokenKind::Op && peek().text == ".") {
      s.targets.push_back(next().text);
      next();
      s.attr = expect_name();
    } else {
      parse_targets(s.targets);
    }
    if (skip_op("=")) {
      s.expr = parse_tuple(true);
      expect_block_end();
      return;
    }
    if (!s.attr.empty() || s.targets.size() != 1) unexpected("'='");
    s.kind = StmtKind::SetBlock;
    if (skip_op("|")) parse_filter_chain(s.filters);
    expect_block_end();
    s.body = subparse({"endset"}, "set", line);
    next();
    expect_block_end();
  }

  void parse_macro(Stmt& s, int line) {
    s.kind = StmtKind::Macro;
    s.name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      if (is_op(")")) break;
      MacroParam p;
      p.name = expect_name();
      if (skip_op("=")) p.default_value = parse_expression(true);
      s.params.push_back(std::move(p));
    }
    next();
    expect_block_end();
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;  // a loop around the definition does not make `break` valid inside it
    s.body = subparse({"endmacro"}, "macro", line);
    loop_depth_ = saved_loops;
    next();
    if (cur().kind == TokenKind::Name && cur().text == s.name) next();
    expect_block_end();
  }

  // `name(args) | name | …` with no object: the filters of a filter or set block.
  void parse_filter_chain(std::vector<ExprPtr>& filters) {
    do {
      filters.push_back(parse_filter(nullptr));
    } while (skip_op("|"));
  }

  // ---- expressions ---------------------------------------------------------

  ExprPtr parse_tuple(bool with_condexpr) {
    const int line = cur().line;
    ExprPtr first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = make(ExprKind::Tuple, line);
    t->items.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().kind == TokenKind::VarEnd || cur().kind == TokenKind::BlockEnd || is_op(")")) break;
      t->items.push_back(parse_expression(with_condexpr));
    }
    return seal(std::move(t));
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const int line = next().line;
      auto c = make(ExprKind::Cond, line);
      c->cond = parse_or();
      c->lhs = std::move(expr);
      if (skip_name("else")) c->rhs = parse_condexpr();
      expr = seal(std::move(c));
    }
    return expr;
  }

  ExprPtr binary(const std::string& op, ExprPtr lhs, ExprPtr rhs, int line) {
    auto b = make(ExprKind::Binary, line);
    b->name = op;
    b->lhs = std::move(lhs);
    b->rhs = std::move(rhs);
    return seal(std::move(b));
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const int line = next().line;
      left = binary("or", std::move(left), parse_and(), line);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const int line = next().line;
      left = binary("and", std::move(left), parse_not(), line);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      auto u = make(ExprKind::Unary, next().line);
      u->name = "not";
      u->object = parse_not();
      return seal(std::move(u));
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().kind == TokenKind::Op &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
           cur().text == ">" || cur().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().kind == TokenKind::Name && peek().text == "in") {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::Compare, line);
        cmp->object = std::move(first);
      }
      cmp->ops.push_back(op);
      cmp->items.push_back(parse_math1());
    }
    return cmp ? seal(std::move(cmp)) : std::move(first);
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      const int line = t.line;
      std::string op = t.text;
      left = binary(op, std::move(left), parse_concat(), line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      const int line = next().line;
      left = binary("~", std::move(left), parse_math2(), line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      const int line = t.line;
      std::string op = t.text;
      left = binary(op, std::move(left), parse_pow(), line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const int line = next().line;
      left = binary("**", std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      node = make(ExprKind::Unary, t.line);
      node->name = t.text;
      node->object = parse_unary(false);
      node = seal(std::move(node));
    } else {
      node = parse_postfix(parse_primary());
    }
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    const int line = t.line;
    if (t.kind == TokenKind::Name) {
      std::string name = next().text;
      auto lit = make(ExprKind::Literal, line);
      if (name == "true" || name == "True") {
        lit->value = Value(true);
      } else if (name == "false" || name == "False") {
        lit->value = Value(false);
      } else if (name == "none" || name == "None") {
        lit->value = Value(None{});
      } else {
        auto n = make(ExprKind::Name, line);
        n->name = name;
        return n;
      }
      return lit;
    }
    if (t.kind == TokenKind::String) {
      std::string s;
      while (cur().kind == TokenKind::String)
        s += next().text;  // adjacent strings join, as in Python
      auto lit = make(ExprKind::Literal, line);
      lit->value = Value(std::move(s));
      return lit;
    }
    if (t.kind == TokenKind::Int || t.kind == TokenKind::Float) {
      auto lit = make(ExprKind::Literal, line);
      lit->value = t.kind == TokenKind::Int ? Value(t.int_value) : Value(t.float_value);
      next();
      return lit;
    }
    if (skip_op("(")) {
      if (skip_op(")")) return make(ExprKind::Tuple, line);
      ExprPtr inner = parse_tuple(true);
      expect_op(")");
      return inner;  // already sealed
    }
    if (skip_op("[")) {
      auto list = make(ExprKind::List, line);
      while (!is_op("]")) {
        if (!list->items.empty()) expect_op(",");
        if (is_op("]")) break;
        list->items.push_back(parse_expression(true));
      }
      next();
      return seal(std::move(list));
    }
    if (skip_op("{")) {
      auto dict = make(ExprKind::Dict, line);
      while (!is_op("}")) {
        if (!dict->keys.empty()) expect_op(",");
        if (is_op("}")) break;
        dict->keys.push_back(parse_expression(true));
        expect_op(":");
        dict->items.push_back(parse_expression(true));
      }
      next();
      return seal(std::move(dict));
    }
    unexpected("an expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      const int line = cur().line;
      if (skip_op(".")) {
        if (cur().kind == TokenKind::Name) {
          auto a = make(ExprKind::Attr, line);
          a->object = std::move(node);
          a->name = next().text;
          node = seal(std::move(a));
        } else if (cur().kind == TokenKind::Int) {
          auto it = make(ExprKind::Item, line);
          it->object = std::move(node);
          it->lhs = make(ExprKind::Literal, line);
          it->lhs->value = Value(next().int_value);
          node = seal(std::move(it));
        } else {
          unexpected("an attribute name");
        }
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    const int line = next().line;  // '['
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (skip_op("]")) {
        auto it = make(ExprKind::Item, line);
        it->object = std::move(object);
        it->lhs = std::move(start);
        return seal(std::move(it));
      }
    }
    auto sl = make(ExprKind::Slice, line);
    sl->object = std::move(object);
    sl->start = std::move(start);
    expect_op(":");
    if (!is_op("]") && !is_op(":")) sl->stop = parse_expression(true);
    if (skip_op(":") && !is_op("]")) sl->step = parse_expression(true);
    expect_op("]");
    return seal(std::move(sl));
  }

  void parse_call_args(Expr& call) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail("*args and **kwargs are not supported in chat templates");
      if (cur().kind == TokenKind::Name && peek().kind == TokenKind::Op && peek().text == "=") {
        std::string key = next().text;
        next();
        call.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!call.kwargs.empty()) fail("positional argument after a keyword argument");
        call.items.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto call = make(ExprKind::Call, cur().line);
    call->object = std::move(callee);
    parse_call_args(*call);
    return seal(std::move(call));
  }

  ExprPtr parse_filter(ExprPtr object) {
    auto f = make(ExprKind::Filter, cur().line);
    f->object = std::move(object);
    f->name = expect_name();
    while (is_op(".")) {
      next();
      f->name += "." + expect_name();
    }
    if (is_op("(")) parse_call_args(*f);
    return seal(std::move(f));
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (skip_op("|")) {
        node = parse_filter(std::move(node));
      } else if (is_name("is")) {
        auto t = make(ExprKind::Test, next().line);
        t->object = std::move(node);
        t->negated = skip_name("not");
        t->name = expect_name();
        if (is_op("(")) {
          parse_call_args(*t);
        } else if ((cur().kind == TokenKind::Name || cur().kind == TokenKind::String ||
                    cur().kind == TokenKind::Int || cur().kind == TokenKind::Float || is_op("[") ||
                    is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") &&
                   !is_name("in") && !is_name("not") && !is_name("is")) {
          // `x is divisibleby 3`: one argument without parentheses
          t->items.push_back(parse_postfix(parse_primary()));
        }
        node = seal(std::move(t));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

Program parse_template(std::string_view source) { return Parser(lex(source)).run(); }

}  // namespace moe::jinja
